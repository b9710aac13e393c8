"""What a study leaves in ``--output_dir``: ``search.json`` / ``search.md`` (every trial), ``best.yaml`` (the best
trial's flags, for ``vlfit train best.yaml``), ``search.png`` (metric per trial with the best so far, and the
parameter importances); and the removal of every trial's checkpoints but the best's.

Everything here reads the study from its storage, so the files describe all of the study's trials, whichever
process ran them; they are rewritten after each trial.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import warnings
from enum import Enum
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from vlfit.atomic_files import replace_on_success
from vlfit.search.study import FINISHED, RESUMES_ATTR, best_trial

logger = logging.getLogger(__name__)

SEARCH_JSON, SEARCH_MD, BEST_YAML, SEARCH_PNG = "search.json", "search.md", "best.yaml", "search.png"
BEST_RUN_DIR = "best"


def trial_record(trial: FrozenTrial, run_dir: str) -> dict[str, Any]:
    """One trial as ``search.json`` lists it."""
    duration = trial.duration.total_seconds() if trial.duration is not None else None
    return {
        "number": trial.number,
        "state": trial.state.name.lower(),
        "value": trial.value,
        "params": trial.params,
        "duration_s": None if duration is None else round(duration, 2),
        "intermediate_values": {str(step): value for step, value in sorted(trial.intermediate_values.items())},
        "last_step": max(trial.intermediate_values) if trial.intermediate_values else None,
        "run_dir": run_dir,
        **({"continues_trial": trial.user_attrs[RESUMES_ATTR]} if RESUMES_ATTR in trial.user_attrs else {}),
    }


def summary(study: optuna.Study, *, metric: str, n_trials: int, storage: str, trial_dirs: dict[int, str]) -> dict:
    """Everything ``search.json`` holds."""
    trials = study.get_trials(deepcopy=False)
    best = best_trial(study)
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    return {
        "study_name": study.study_name,
        "storage": storage,
        "metric": metric,
        "direction": study.direction.name.lower(),
        "n_trials": n_trials,
        "finished": sum(1 for t in trials if t.state in FINISHED),
        "states": counts,
        "best": None
        if best is None
        else {"number": best.number, "value": best.value, "params": best.params, "run_dir": trial_dirs[best.number]},
        "trials": [trial_record(t, trial_dirs[t.number]) for t in trials],
    }


def write_json(data: dict[str, Any], path: str) -> None:
    with replace_on_success(path) as temp, open(temp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_markdown(data: dict[str, Any], path: str) -> None:
    """``search.md``: the best trial, then one row per trial (parameters, metric, state, duration)."""
    names = list(dict.fromkeys(name for t in data["trials"] for name in t["params"]))
    metric = data["metric"]
    lines = [f"# Search {data['study_name']}: {data['direction']} {metric}", ""]
    best = data["best"]
    if best is None:
        lines.append("No trial has finished yet.")
    else:
        params = ", ".join(f"`{k}` = {_cell(v)}" for k, v in best["params"].items())
        lines.append(
            f"Best: trial {best['number']}, {metric} **{best['value']:.4f}** ({params}); `vlfit train best.yaml`"
        )
    states = ", ".join(f"{n} {state}" for state, n in sorted(data["states"].items()))
    lines += ["", f"{data['finished']} of {data['n_trials']} trials finished ({states}).", ""]
    header = ["trial", "state", metric, *names, "last step", "duration (s)"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for t in data["trials"]:
        value = _cell(t["value"])
        if t["state"] == "pruned" and t["intermediate_values"]:  # Optuna's value of a pruned trial: its last report
            value = f"({_cell(list(t['intermediate_values'].values())[-1])})"
        row = [str(t["number"]), t["state"], value, *(_cell(t["params"].get(n)) for n in names)]
        lines.append("| " + " | ".join([*row, _cell(t["last_step"]), _cell(t["duration_s"])]) + " |")
    lines += ["", "A pruned trial's metric in parentheses is its last evaluation before it was stopped.", ""]
    with replace_on_success(path) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def best_flags(base: dict[str, Any], params: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """The flags of ``vlfit train best.yaml``: the search's train flags with the best parameters, into
    ``<output_dir>/best``."""
    values = {**base, **params}
    values["output_dir"] = os.path.join(output_dir, BEST_RUN_DIR)
    values["do_eval"] = True
    return {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}  # argparse gives enum members


def write_best_yaml(base: dict[str, Any], best: FrozenTrial, output_dir: str, metric: str, path: str) -> None:
    flags = best_flags(base, best.params, output_dir)
    header = f"# vlfit search: trial {best.number}, {metric} {best.value:.4f}. Run: vlfit train {path}\n"
    with replace_on_success(path) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(header)
        yaml.safe_dump(flags, f, sort_keys=False)


def importances(study: optuna.Study) -> dict[str, float]:
    """Optuna's parameter importances over the complete trials; empty while there are too few to tell."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():  # "importances will be equal" when every trial scored the same
            warnings.simplefilter("ignore", UserWarning)
            return dict(optuna.importance.get_param_importances(study))
    except (RuntimeError, ValueError, ZeroDivisionError) as err:  # one value for every trial, a constant parameter
        logger.info("parameter importances not available: %s", err)
        return {}


def write_png(study: optuna.Study, metric: str, path: str) -> None:
    """Left: the metric of each trial (pruned ones at their last evaluation) and the best so far. Right: importances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    trials = study.get_trials(deepcopy=False)
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    best = -math.inf if maximize else math.inf
    best_x, best_y = [], []
    for state, color, marker in ((TrialState.COMPLETE, "tab:blue", "o"), (TrialState.PRUNED, "tab:gray", "x")):
        xs = [t.number for t in trials if t.state == state and _shown_value(t) is not None]
        ys = [_shown_value(t) for t in trials if t.state == state and _shown_value(t) is not None]
        left.scatter(xs, ys, color=color, marker=marker, label=state.name.lower())
    for t in trials:
        if t.state == TrialState.COMPLETE and t.value is not None:
            best = max(best, t.value) if maximize else min(best, t.value)
        if math.isfinite(best):
            best_x.append(t.number)
            best_y.append(best)
    left.step(best_x, best_y, where="post", color="tab:orange", label="best so far")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel("trial")
    left.set_ylabel(metric)
    left.set_title(f"{metric} per trial")
    left.legend(loc="best")
    scores = importances(study)
    if scores:
        names = list(scores)[::-1]
        right.barh(names, [scores[n] for n in names], color="tab:green")
        right.set_xlabel("importance (fraction)")
    else:
        right.text(0.5, 0.5, "importances need at least two\ncomplete trials that differ", ha="center", va="center")
        right.set_xticks([])
        right.set_yticks([])
    right.set_title("parameter importances")
    fig.tight_layout()
    with replace_on_success(path) as temp:
        fig.savefig(temp, format="png", dpi=100)
    plt.close(fig)


def _shown_value(trial: FrozenTrial) -> float | None:
    if trial.value is not None:
        return trial.value
    if trial.intermediate_values:
        return trial.intermediate_values[max(trial.intermediate_values)]
    return None


def top_trials(study: optuna.Study, k: int) -> list[FrozenTrial]:
    """The ``k`` best complete trials, best first."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return sorted(complete, key=lambda t: (-t.value if maximize else t.value, t.number))[:k]  # type: ignore[operator]


def remove_checkpoints(study: optuna.Study, trial_dirs: dict[int, str], keep_weights: int = 1) -> list[str]:
    """Delete the checkpoints and saved weights of every finished trial but the best, and of interrupted trials
    that a later trial continued; the ``keep_weights`` best trials keep their final weights (a soup's
    ingredients: ``--soup``). Returns what was removed."""
    best = best_trial(study)
    kept = {t.number for t in top_trials(study, keep_weights)}
    trials = study.get_trials(deepcopy=False)
    continued = {t.user_attrs.get(RESUMES_ATTR) for t in trials if t.state in FINISHED}
    removed = []
    for trial in trials:
        if best is not None and trial.number == best.number:
            continue
        done = trial.state in FINISHED or (trial.state == TrialState.FAIL and trial.number in continued)
        folder = trial_dirs.get(trial.number)
        if not done or folder is None or not os.path.isdir(folder):
            continue
        for path in sorted(glob.glob(os.path.join(folder, "checkpoint-*"))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        if trial.number in kept:
            continue
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            os.remove(path)
            removed.append(path)
    return removed


def write_reports(
    study: optuna.Study,
    *,
    base: dict[str, Any],
    metric: str,
    n_trials: int,
    storage: str,
    output_dir: str,
    trial_dirs: dict[int, str],
) -> dict[str, Any]:
    """Write ``search.json``, ``search.md``, ``best.yaml`` (once a trial is complete) and ``search.png``."""
    data = summary(study, metric=metric, n_trials=n_trials, storage=storage, trial_dirs=trial_dirs)
    write_json(data, os.path.join(output_dir, SEARCH_JSON))
    write_markdown(data, os.path.join(output_dir, SEARCH_MD))
    best = best_trial(study)
    if best is not None:
        write_best_yaml(base, best, output_dir, metric, os.path.join(output_dir, BEST_YAML))
    write_png(study, metric, os.path.join(output_dir, SEARCH_PNG))
    return data
