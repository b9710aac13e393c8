"""One trial is one ``vlfit train`` run (``vlfit.training.run.run``, the same ``VlfitTrainer``) in ``trial-N/``.

Why the study is driven here and not by ``Trainer.hyperparameter_search(backend="optuna")``: transformers'
``run_hp_search_optuna`` (``transformers/integrations/integration_utils.py``) does pass ``storage``,
``study_name``, ``sampler`` and ``pruner`` on to ``optuna.create_study``, and its Trainer reports every evaluation
to the trial and raises ``TrialPruned``, but it cannot do the rest of ``vlfit search``:

- resume: ``study.optimize(n_trials=...)`` runs that many *more* trials (it takes no callbacks, so not even
  ``MaxTrialsCallback``), and it never resumes a trial from a checkpoint (its ``checkpoint_dir`` is always
  ``None``);
- interruption: a SIGTERM makes vlfit's preemption handler stop training early, after which its objective returns
  the partial run's metric and the interrupted trial is recorded as *complete*;
- torchrun: processes other than 0 replay a ``FixedTrial`` for ``n_trials`` iterations whatever process 0 does, so
  a pruned trial (``FixedTrial.should_prune`` is always False), a ``--timeout`` or a resumed study's shorter count
  leaves them in a different trial from process 0, waiting in a collective that never comes;
- trial arguments: ``_hp_search_setup`` sets ``TrainingArguments`` fields only, on the one Trainer's args; a
  model or data flag (``--logit_scale_init_value``, ``--max_seq_length``) cannot be searched.

So Optuna is driven directly (ask and tell until ``--n_trials`` have finished), each trial trains with the
same ``run()`` and Trainer as ``vlfit train`` (a fresh model per trial, as ``model_init`` gives the
Trainer's own search), and ``TrialReporter`` is the Trainer's ``_report_to_hp_search`` as a callback: it reports
the metric at each evaluation and stops a trial the pruner rejects, with the decision of process 0 broadcast to
every process.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from transformers import HfArgumentParser, TrainerCallback

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.errors import ConfigError
from vlfit.models.loading import build_model
from vlfit.models.logit_scale import logit_scale_parameter
from vlfit.search.space import LOGIT_SCALE_PARAMETER, SearchSpace
from vlfit.search.study import CHECKPOINT_ATTR, FINISHED, RESUME_FROM_ATTR
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import RunSetup, run, setup_run
from vlfit.training.trainer import VlfitTrainer

logger = logging.getLogger(__name__)

TRIAL_DIR = "trial-{number}"
# Samples the metric check evaluates before the first trial: enough for every metric evaluation reports.
PROBE_SAMPLES = 16
# Model flags only building the model reads: a trial that changes them reuses the command's data and tokenizer.
_BUILD_FIELDS = frozenset(
    {"freeze_vision_model", "freeze_text_model", "freeze_text_pooler", "attn_implementation", LOGIT_SCALE_PARAMETER}
)
_SETUP_FIELDS = frozenset(f.name for cls in (ModelArguments, DataArguments) for f in fields(cls)) - _BUILD_FIELDS


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def broadcast(value: Any) -> Any:
    """Process 0's ``value`` on every process (one object; a no-op without a process group)."""
    if not is_distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def trial_dir(output_dir: str, number: int) -> str:
    return os.path.join(output_dir, TRIAL_DIR.format(number=number))


def check_trial_dirs(output_dir: str, study: optuna.Study) -> None:
    """Refuse an output folder holding ``trial-N`` runs the study does not know (another study's, or a deleted
    one's): a new trial N would take up that run's last checkpoint as its own.

    Raises:
        ValueError: Naming the folders.
    """
    known = {t.number for t in study.get_trials(deepcopy=False)}
    pattern = re.compile(TRIAL_DIR.format(number=r"(\d+)") + "$")
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    strangers = sorted(n for n in names if (m := pattern.match(n)) and int(m.group(1)) not in known)
    if strangers:
        raise ConfigError(
            f"{output_dir} holds runs that are not trials of study {study.study_name!r} ({', '.join(strangers[:3])}"
            f"{', ...' if len(strangers) > 3 else ''}): pass another --output_dir (one per study), or remove them"
        )


def trial_values(base: dict[str, Any], params: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """The ``vlfit train`` flags of a trial: the command's, the trial's parameters, its own output folder."""
    values = {**base, **params}
    values.update(output_dir=output_dir, do_train=True, do_eval=True)
    return values


def parse_train_values(values: dict[str, Any]) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments]:
    parser = HfArgumentParser((ModelArguments, DataArguments, VlfitTrainingArguments))
    return parser.parse_dict(values)  # type: ignore[return-value]


def available_metrics(
    setup: RunSetup, model_args: ModelArguments, training_args: VlfitTrainingArguments, space: SearchSpace
) -> list[str]:
    """The metrics evaluation reports, from one evaluation of a freshly built model on a few validation samples.

    Raises:
        ValueError: The space sets ``logit_scale_init_value`` and the model has no logit scale.
    """
    assert setup.eval_source is not None
    model = build_model(setup.spec, **model_args.build_keywords())
    if LOGIT_SCALE_PARAMETER in space.names and logit_scale_parameter(model) is None:
        raise ConfigError(
            f"--search_space: {LOGIT_SCALE_PARAMETER}: the model ({setup.spec.description}) has no "
            "logit_scale parameter to set"
        )
    source = setup.eval_source
    source = source.select(range(min(len(source), PROBE_SAMPLES)))
    trainer = VlfitTrainer(
        model=model,
        args=training_args,
        eval_dataset=setup.pipeline.dataset(source, train=False),
        processing_class=setup.pipeline.inputs.tokenizer,
        pipeline=setup.pipeline,
        family=setup.spec.family,
    )
    metrics = trainer.evaluate()
    del trainer, model
    return sorted(name for name in metrics if name.startswith("eval_"))  # the Trainer's log adds "epoch"


class TrialReporter(TrainerCallback):
    """Reports the metric of every evaluation during training to the trial; raises ``optuna.TrialPruned`` when the
    pruner stops it.

    Args:
        trial: The Optuna trial on process 0; ``None`` on the other processes (they follow process 0's decision).
        metric: The metric's key in the evaluation's results.
    """

    def __init__(self, trial: optuna.Trial | None, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.reported: dict[int, float] = {}
        self._training = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kw: Any):
        if not metrics or self.metric not in metrics:
            return
        step, value = state.global_step, float(metrics[self.metric])
        prune = False
        if self.trial is not None and step not in self.reported:
            self.trial.report(value, step)
            # The final evaluation after training is reported (later trials are compared with it) but prunes nothing.
            prune = self._training and self.trial.should_prune()
        self.reported[step] = value
        if broadcast(prune):
            logger.info("pruned at step %d: %s %.4f is worse than the pruner allows", step, self.metric, value)
            raise optuna.TrialPruned(f"pruned at step {step} ({self.metric} {value:.4f})")


@dataclass
class TrialOrder:
    """What process 0 tells every process before a trial: which one, with which parameters, from where."""

    number: int
    params: dict[str, Any]
    resume_from_checkpoint: str | None = None


class TrialRunner:
    """Trains and evaluates one trial on every process; process 0 also talks to the study.

    Args:
        base: The ``vlfit train`` flags of the command (given ones only).
        space: The search space.
        setup: The command's data, spec and pipeline, reused by trials that change no model or data flag.
        metric: The metric to optimize.
        output_dir: The search's output folder (trials go in ``trial-N/``).
        is_main: Whether this is process 0 (writes files).
    """

    def __init__(
        self,
        base: dict[str, Any],
        space: SearchSpace,
        setup: RunSetup,
        metric: str,
        output_dir: str,
        is_main: bool,
    ) -> None:
        self.base = base
        self.space = space
        self.setup = setup
        self.metric = metric
        self.output_dir = output_dir
        self.is_main = is_main
        self.durations: dict[int, float] = {}

    def lead(
        self,
        study: optuna.Study,
        n_trials: int,
        *,
        timeout: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        after_trial: Callable[[], None] = lambda: None,
    ) -> None:
        """Process 0: ask the study for trials and tell it their outcome until ``n_trials`` have finished (complete
        or pruned), ``timeout`` seconds have passed or ``should_stop()``; then tell the other processes it is over.

        Optuna's ask-and-tell interface rather than ``study.optimize``: an interrupted trial is told failed without
        a logged traceback, and the count is of finished trials, whatever an earlier process left.

        Raises:
            TrainingPreempted: A signal stopped the trial in progress (told failed, with its checkpoint recorded).
        """
        start = time.monotonic()
        while len(study.get_trials(deepcopy=False, states=FINISHED)) < n_trials:
            if should_stop() or (timeout is not None and time.monotonic() - start > timeout):
                break
            trial = study.ask()
            try:
                value = self.objective(trial)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
            except TrainingPreempted as stop:
                if stop.checkpoint:
                    trial.set_user_attr(CHECKPOINT_ATTR, os.path.abspath(stop.checkpoint))
                study.tell(trial, state=TrialState.FAIL)
                logger.warning("trial %d interrupted: recorded as failed", trial.number)
                raise  # the other processes stopped at the same step
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            else:
                study.tell(trial, value)
            after_trial()
        broadcast(None)

    def objective(self, trial: optuna.Trial) -> float:
        """Sample the trial's parameters, tell the other processes, train; the final evaluation's metric."""
        params = self.space.suggest(trial)
        resume = trial.user_attrs.get(RESUME_FROM_ATTR)
        order = broadcast(TrialOrder(trial.number, params, resume if resume and os.path.isdir(resume) else None))
        return self.run_trial(order, trial)

    def follow(self) -> None:
        """The other processes: run each trial process 0 orders, until it says the study is over (``None``)."""
        while (order := broadcast(None)) is not None:
            try:
                self.run_trial(order, None)
            except optuna.TrialPruned:
                continue

    def run_trial(self, order: TrialOrder, trial: optuna.Trial | None) -> float:
        start = time.monotonic()
        out = trial_dir(self.output_dir, order.number)
        model_args, data_args, training_args = parse_train_values(trial_values(self.base, order.params, out))
        if order.resume_from_checkpoint is not None:
            training_args.resume_from_checkpoint = order.resume_from_checkpoint
        setup = self.setup
        if _SETUP_FIELDS & set(order.params):  # a model or data flag: its own tokenizer, pipeline, splits
            setup = setup_run(model_args, data_args, training_args)
        described = ", ".join(f"{k}={_short(v)}" for k, v in order.params.items())
        continued = f", continuing {order.resume_from_checkpoint}" if order.resume_from_checkpoint else ""
        logger.info("trial %d: %s%s", order.number, described, continued)
        reporter = TrialReporter(trial, self.metric)
        try:
            results = run(model_args, data_args, training_args, setup=setup, callbacks=[reporter])
        finally:
            self.durations[order.number] = time.monotonic() - start
        value = results.get(self.metric)
        if value is None:
            raise RuntimeError(f"the final evaluation of trial {order.number} reported no {self.metric}")
        logger.info("trial %d: %s %.4f (%.0f s)", order.number, self.metric, value, self.durations[order.number])
        return float(value)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
