"""``vlfit search``: hyperparameter search over ``vlfit train`` runs with Optuna; persistent, resumable, pruned.

Every ``vlfit train`` flag sets what each trial shares; ``vlfit.search.study.SearchArguments`` adds the study's own
flags. Each trial is a ``vlfit train`` run in ``<output_dir>/trial-N`` whose final evaluation gives the metric.
Before the first trial, the space, the storage and the metric are checked (one evaluation of an untrained model
on a few validation samples lists the metrics there are). Process 0 talks to the study; under torchrun every
process trains each trial. Running the same command again continues the study. Why Optuna is driven here rather
than through ``Trainer.hyperparameter_search``: ``vlfit.search.objective``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import fields
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.commands.parsing import CommandParser, is_flags_file, load_flags_file
from vlfit.errors import ConfigError
from vlfit.logs import quiet_replicas
from vlfit.search.objective import TrialRunner, available_metrics, check_trial_dirs, parse_train_values, trial_dir
from vlfit.search.report import remove_checkpoints, write_reports
from vlfit.search.space import SearchSpace, default_space, describe, load_space
from vlfit.search.study import (
    SearchArguments,
    StopRequest,
    best_trial,
    finished_count,
    make_pruner,
    open_storage,
    open_study,
    storage_url,
    take_up_interrupted,
)
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import setup_run

logger = logging.getLogger(__name__)

PROG = "vlfit search"
_SEARCH_FIELDS = frozenset(f.name for f in fields(SearchArguments))


def _parser() -> CommandParser:
    return CommandParser((ModelArguments, DataArguments, VlfitTrainingArguments, SearchArguments), prog=PROG)


def parse_search_arguments(
    argv: list[str],
) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments, SearchArguments, dict[str, Any]]:
    """The four argument groups, and the ``vlfit train`` flags given (by name, as parsed): what trials share."""
    if is_flags_file(argv):
        values = load_flags_file(argv[0])
        parsed = _parser().parse_dict(values)
        given = values
    else:
        parsed = _parser().parse_args_into_dataclasses(args=argv)  # a bad flag stops here, with the usage
        raw = _parser()
        for action in raw._actions:  # a SUPPRESS default leaves a flag not given out of the namespace
            action.default = argparse.SUPPRESS
        given = vars(raw.parse_known_args(argv)[0])
    base = {k: v for k, v in given.items() if k not in _SEARCH_FIELDS}
    if base.get("resume_from_checkpoint"):
        raise ConfigError(
            "--resume_from_checkpoint: vlfit search continues its study and interrupted trial by itself; rerun the "
            "same command without it"
        )
    return (*parsed, base)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit search``. Returns 0, or ``128 + signal`` when SIGTERM/SIGINT stopped the study."""
    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, data_args, training_args, search_args, base = parse_search_arguments(argv)
    quiet_replicas(training_args.get_process_log_level(), training_args.should_log)
    is_main = training_args.process_index == 0
    output_dir = training_args.output_dir
    space: SearchSpace | None = load_space(search_args.search_space) if search_args.search_space else None
    url = storage_url(search_args, output_dir)
    storage = None
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        storage = open_storage(url)

    training_args.do_train = training_args.do_eval = True
    setup = setup_run(model_args, data_args, training_args)
    if space is None:
        space = default_space(contrastive=hasattr(setup.spec.config, "logit_scale_init_value"))
    # The check's evaluation logs nowhere (--report_to would start a tracker run for it).
    probe_args = parse_train_values({**base, "output_dir": output_dir, "report_to": "none"})[2]
    metrics = available_metrics(setup, model_args, probe_args, space)
    if search_args.metric not in metrics:
        raise ConfigError(
            f"--metric {search_args.metric}: evaluation does not report it; it reports: {', '.join(metrics)}"
        )
    if search_args.pruner != "none" and training_args.eval_strategy.value == "no":
        logger.warning(
            "--pruner %s has nothing to judge: no evaluation during training (pass --eval_strategy steps "
            "--eval_steps N)", search_args.pruner,
        )  # fmt: skip
    logger.info("search space: %s", describe(space))

    runner = TrialRunner(base, space, setup, search_args.metric, output_dir, is_main)
    stop = StopRequest()
    try:
        if is_main:
            return _lead(runner, search_args, training_args, storage, url, space, stop)
        runner.follow()
        return 0
    except TrainingPreempted as preempted:
        if is_main:
            print(f"{PROG}: {interrupted_message(preempted)}", file=sys.stderr)
        return preempted.exit_code
    finally:
        stop.uninstall()


def _soup(runner: TrialRunner, search_args: SearchArguments, study: Any, training_args: VlfitTrainingArguments) -> None:
    """End the study with a soup of its best trials (``--soup``), in ``<output_dir>/soup``."""
    from vlfit.search.report import top_trials
    from vlfit.search.trial_soup import SOUP_DIR, soup_of_trials

    if training_args.world_size > 1:
        logger.warning("--soup: the soup is made by one process; run vlfit merge --method %s --search_dir %s "
                       "--top_k %d (with the data flags) after this study", search_args.soup, runner.output_dir,
                       search_args.soup_top_k)  # fmt: skip
        return
    trials = top_trials(study, search_args.soup_top_k)
    runs = [trial_dir(runner.output_dir, trial.number) for trial in trials]
    result = soup_of_trials(runs, runner.base, search_args.metric, os.path.join(runner.output_dir, SOUP_DIR),
                            method=search_args.soup, command_line=f"{PROG} --soup {search_args.soup}")  # fmt: skip
    kept = result.record.get("kept", runs)
    logger.info("%s soup of %d of the %d best trials (%s): %s %.4f (best trial %.4f); saved to %s", search_args.soup,
                len(kept), len(runs), ", ".join(os.path.basename(run) for run in kept), search_args.metric,
                result.metrics[search_args.metric], trials[0].value, result.output_dir)  # fmt: skip


def interrupted_message(preempted: TrainingPreempted) -> str:
    """What to tell the user when a signal stopped the trial in progress."""
    name = signal.Signals(preempted.signum).name
    if preempted.checkpoint:
        then = f"a new trial with its parameters continues from its checkpoint {preempted.checkpoint}"
    else:
        then = "it saved no checkpoint"
    return f"{name} stopped the trial in progress, recorded as failed. Rerun the same command to continue: {then}."


def _lead(
    runner: TrialRunner,
    search_args: SearchArguments,
    training_args: VlfitTrainingArguments,
    storage: Any,
    url: str,
    space: SearchSpace,
    stop: StopRequest,
) -> int:
    """Process 0: open the study, run what is left of ``--n_trials``, write the reports."""
    eval_steps = None
    if training_args.eval_strategy.value == "steps" and training_args.eval_steps and training_args.eval_steps >= 1:
        eval_steps = int(training_args.eval_steps)
    pruner = make_pruner(search_args, eval_steps, training_args.max_steps)
    study = open_study(search_args, storage, training_args.seed, pruner, space.fingerprint())
    check_trial_dirs(runner.output_dir, study)
    continued = take_up_interrupted(study, storage)
    if continued:
        logger.info("continuing interrupted trial(s) %s from their checkpoints", ", ".join(map(str, continued)))
    done = finished_count(study)
    remaining = max(search_args.n_trials - done, 0)
    logger.info(
        "study %r (%s): %d of %d trials finished, %d to run", study.study_name, url, done, search_args.n_trials,
        remaining,
    )  # fmt: skip

    def reports() -> None:
        dirs = {t.number: trial_dir(runner.output_dir, t.number) for t in study.get_trials(deepcopy=False)}
        if not search_args.keep_trial_checkpoints:
            remove_checkpoints(study, dirs, keep_weights=search_args.soup_top_k if search_args.soup != "none" else 1)
        write_reports(
            study, base=runner.base, metric=search_args.metric, n_trials=search_args.n_trials, storage=url,
            output_dir=runner.output_dir, trial_dirs=dirs,
        )  # fmt: skip

    try:
        runner.lead(
            study, search_args.n_trials, timeout=search_args.timeout, should_stop=lambda: stop.received is not None,
            after_trial=reports,
        )  # fmt: skip
    finally:
        reports()
    data_done = finished_count(study)
    best = best_trial(study)
    if best is not None:
        logger.info(
            "best: trial %d, %s %.4f; %s written (vlfit train %s)", best.number, search_args.metric, best.value,
            "search.json, search.md, best.yaml, search.png", os.path.join(runner.output_dir, "best.yaml"),
        )  # fmt: skip
    if stop.received is None and best is not None and search_args.soup != "none":
        _soup(runner, search_args, study, training_args)
    if stop.received is not None:
        print(
            f"{PROG}: stopped by {signal.Signals(stop.received).name} after a trial: {data_done} of "
            f"{search_args.n_trials} trials finished. Rerun the same command to continue.",
            file=sys.stderr,
        )
        return 128 + stop.received
    return 0
