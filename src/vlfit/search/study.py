"""The study: its flags, storage, sampler and pruner, and how a study left by a killed process is taken up again.

A study lives in its storage (an SQLite file in ``--output_dir`` by default, or any SQLAlchemy URL), so running the
same ``vlfit search`` command again continues it: trials that finished (complete or pruned) are kept and count
towards ``--n_trials``; a trial the last process left running is recorded as failed, and when it had saved a
checkpoint (SIGTERM/SIGINT during training saves one) a new trial with the same parameters continues from it.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.training.preemption import PREEMPTION_SIGNALS, TwoStageSignalHandler

logger = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = ("maximize", "minimize")
SOUPS = ("none", "greedy")
DEFAULT_METRIC = "eval_t2i_recall@1"
STUDY_DB = "search.db"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
# User attributes a trial keeps in the storage.
CHECKPOINT_ATTR = "checkpoint"  # the checkpoint an interrupted trial saved
RESUMES_ATTR = "resumes"  # the number of the interrupted trial this one continues
RESUME_FROM_ATTR = "resume_from_checkpoint"
SPACE_ATTR = "search_space"  # study attribute: the space's fingerprint


@dataclass
class SearchArguments:
    """``vlfit search``'s own flags (beside every ``vlfit train`` flag; ``--seed`` also seeds the sampler)."""

    search_space: str | None = flag(
        None,
        "YAML or JSON file: for each parameter (any vlfit train field) {type: float|int, low, high, "
        "log, step} or {type: categorical, choices}. Default: learning_rate, "
        "warmup_steps, weight_decay and, for contrastive models, logit_scale_init_value.",
    )
    n_trials: int = flag(12, "Finished trials (complete or pruned) the study ends with.")
    timeout: float | None = flag(None, "Start no new trial after this many seconds of this command.")
    metric: str = flag(
        DEFAULT_METRIC, "Metric of the final evaluation to optimize (any vlfit eval reports; eval_ optional)."
    )
    direction: str = flag("maximize", "maximize or minimize the metric.", choices=DIRECTIONS)
    sampler: str = flag("tpe", "tpe (Optuna's default) or random.", choices=SAMPLERS)
    pruner: str = flag(
        "median",
        "Stop poor trials at an evaluation during training (needs --eval_strategy steps): median "
        "(worse than the median of earlier trials at the same step), hyperband, or none.",
        choices=PRUNERS,
    )
    pruner_startup_trials: int = flag(2, "The median pruner prunes nothing until this many trials have finished.")
    storage: str | None = flag(None, f"Study storage URL (default: sqlite:///<output_dir>/{STUDY_DB}).")
    study_name: str = flag("vlfit-search", "Name of the study in the storage.")
    keep_trial_checkpoints: bool = flag(
        False, "Keep every trial's checkpoints and weights (default: only the best trial's)."
    )
    soup: str = flag(
        "none",
        "End the study with a soup of its best trials, saved to <output_dir>/soup: greedy (the "
        "--soup_top_k best trials in order of --metric, each kept only when the soup's --metric on the "
        "evaluation split does not drop; vlfit merge --method greedy), or none.",
        choices=SOUPS,
    )
    soup_top_k: int = flag(4, "With --soup: how many of the best trials go in (their weights are kept).")

    def __post_init__(self) -> None:
        for name, allowed in (("direction", DIRECTIONS), ("sampler", SAMPLERS), ("pruner", PRUNERS), ("soup", SOUPS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown --{name} {getattr(self, name)!r}; choose one of: {', '.join(allowed)}")
        if self.n_trials < 1:
            raise ConfigError(f"--n_trials must be at least 1, got {self.n_trials}")
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout}")
        if not self.metric.startswith("eval_"):
            self.metric = f"eval_{self.metric}"
        if self.soup_top_k < 1:
            raise ConfigError(f"--soup_top_k must be at least 1, got {self.soup_top_k}")
        if self.soup != "none" and self.direction != "maximize":
            raise ConfigError(f"--soup {self.soup} keeps a trial when the soup's --metric does not drop: it needs a "
                              "metric to maximize (--direction maximize), not a loss")  # fmt: skip


def storage_url(args: SearchArguments, output_dir: str) -> str:
    """``--storage``, or the SQLite file in ``output_dir``."""
    return args.storage or f"sqlite:///{os.path.abspath(os.path.join(output_dir, STUDY_DB))}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Connect to the study storage; an unreachable or malformed URL is a ``ValueError`` in one line."""
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as err:  # sqlalchemy's errors (bad URL, no driver, no server, unwritable file) have no common base
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"--storage {url}: cannot open the study storage ({type(err).__name__}: {first})") from None


def make_sampler(args: SearchArguments, seed: int) -> optuna.samplers.BaseSampler:
    if args.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(args: SearchArguments, eval_steps: int | None, max_steps: int | None) -> optuna.pruners.BasePruner:
    """The pruner; trials report at global steps, so Hyperband's resources are steps (from the first evaluation)."""
    if args.pruner == "none":
        return optuna.pruners.NopPruner()
    if args.pruner == "hyperband":
        max_resource: int | str = max_steps if max_steps and max_steps > 0 else "auto"
        return optuna.pruners.HyperbandPruner(min_resource=eval_steps or 1, max_resource=max_resource)
    return optuna.pruners.MedianPruner(n_startup_trials=args.pruner_startup_trials)


def open_study(
    args: SearchArguments,
    storage: optuna.storages.BaseStorage,
    seed: int,
    pruner: optuna.pruners.BasePruner,
    space: str,
) -> optuna.Study:
    """Create the study or load the one of that name; a loaded study must search the same space in the same
    direction."""
    study = optuna.create_study(
        storage=storage, study_name=args.study_name, direction=args.direction, pruner=pruner, load_if_exists=True
    )
    # Seeded by --seed and the trials there are: a resumed study does not sample its first trials' values again.
    study.sampler = make_sampler(args, seed + len(study.get_trials(deepcopy=False)))
    if study.direction.name.lower() != args.direction:
        raise ConfigError(
            f"study {args.study_name!r} in the storage maximizes or minimizes the other way "
            f"({study.direction.name.lower()}); pass --direction {study.direction.name.lower()} or a new --study_name"
        )
    stored = study.user_attrs.get(SPACE_ATTR)
    if stored is None:
        study.set_user_attr(SPACE_ATTR, space)
    elif stored != space:
        raise ConfigError(
            f"study {args.study_name!r} in the storage searched another space ({stored}); pass the same "
            "--search_space to continue it, or a new --study_name"
        )
    return study


def finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def take_up_interrupted(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """Record the trials a killed process left running as failed, and queue a continuation of each failed trial
    that saved a checkpoint and was not continued yet.

    One ``vlfit search`` process (group) works on a study at a time: a trial still running at start-up belongs to
    a process that is gone.

    Returns:
        The numbers of the trials that will be continued.
    """
    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            logger.warning("trial %d was left running by a process that is gone: recorded as failed", trial.number)
    continued = {t.user_attrs.get(RESUMES_ATTR) for t in trials}
    queued = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        checkpoint = trial.user_attrs.get(CHECKPOINT_ATTR)
        if checkpoint and os.path.isdir(checkpoint) and trial.number not in continued:
            study.enqueue_trial(trial.params, user_attrs={RESUMES_ATTR: trial.number, RESUME_FROM_ATTR: checkpoint})
            queued.append(trial.number)
            continued.add(trial.number)
    return queued


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial, or ``None`` before the first one."""
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


class StopRequest(TwoStageSignalHandler):
    """SIGTERM/SIGINT between trainings: finish the trial in progress, then stop the study.

    During training the run's own preemption handler takes the signal (saving a checkpoint); it puts this one back
    when training ends. A second signal exits at once, as for ``vlfit train``.

    Attributes:
        received: The first signal received, or ``None``.
    """

    announcement = "\nvlfit search: received {name}: stopping after this trial\n"

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        super().__init__()
        self.install(signals)
