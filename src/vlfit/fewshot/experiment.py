"""Every method over shot counts and seeds, on one model and one labelled dataset.

For each seed and shot count the same shots serve every method; accuracy is measured on the whole evaluation
split (its usable images). Zero-shot uses no shot: it is measured once. SetFit starts every run from the model's
own weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from vlfit.data.image_inputs import select_images
from vlfit.data.sources.labelled import DEFAULT_TEMPLATES, LabelledSplit
from vlfit.errors import ConfigError
from vlfit.evaluation.zeroshot import class_embeddings, model_scale
from vlfit.fewshot.heads import (
    DEFAULT_ANCHOR_STRENGTH,
    DEFAULT_C,
    LinearHead,
    anchored_candidates,
    anchored_name,
    choose_head,
    logistic_candidates,
    logistic_name,
    zeroshot_head,
)
from vlfit.fewshot.images import decode_rows, embed_images
from vlfit.fewshot.setfit import SetFitSettings, WeightSnapshot, image_parameters, tune_image_tower
from vlfit.fewshot.shots import ShotSampler, check_shot_counts
from vlfit.inference.backends import TorchEncoder

METHODS: tuple[str, ...] = ("zeroshot", "linear_probe", "setfit")


@dataclass
class FewShotSettings:
    """Attributes:
    shot_counts: Images per class to train on.
    seeds: The seeds (each draws other shots).
    methods: A subset of ``METHODS``.
    templates: Zero-shot prompt templates (``{}`` is the class name).
    setfit: SetFit's fine-tuning.
    anchor_setfit_head: Let cross-validation pick a SetFit head anchored at the zero-shot head.
    batch_size: Images per forward pass when embedding.
    num_workers: Loader worker processes decoding images.
    """

    shot_counts: Sequence[int] = (1, 2, 4, 8, 16)
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    methods: Sequence[str] = METHODS
    templates: Sequence[str] = DEFAULT_TEMPLATES
    setfit: SetFitSettings = field(default_factory=SetFitSettings)
    anchor_setfit_head: bool = True
    batch_size: int = 64
    num_workers: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"--methods: unknown {unknown or 'none given'}; choose from {', '.join(METHODS)}")
        if not self.seeds:
            raise ConfigError("--seeds must be at least 1")
        self.shot_counts = sorted(set(self.shot_counts))


@dataclass
class MethodRun:
    """One method at one shot count and seed (zero-shot: ``shots`` 0, one run)."""

    method: str
    shots: int
    seed: int
    accuracy: float
    head: str
    seconds: float

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("method", "shots", "seed", "accuracy", "head", "seconds")}


@dataclass
class KeptClassifier:
    """A run's classifier, kept for ``--save_classifier``: its head, and for SetFit the tuned image weights
    (``image_weights.restore()`` puts them into the image tower)."""

    run: MethodRun
    head: LinearHead
    image_weights: WeightSnapshot | None = None


@dataclass
class FewShotResults:
    runs: list[MethodRun]
    kept: dict[tuple[str, int, int], KeptClassifier]
    eval_count: int
    bad_samples: list[dict[str, str]]

    def summary(self) -> dict[str, dict[int, dict[str, float]]]:
        """Method -> shot count -> mean, std (over seeds, population) and number of runs."""
        table: dict[str, dict[int, dict[str, float]]] = {}
        for method in dict.fromkeys(run.method for run in self.runs):
            by_shots: dict[int, list[float]] = {}
            for run in self.runs:
                if run.method == method:
                    by_shots.setdefault(run.shots, []).append(run.accuracy)
            table[method] = {
                shots: {"mean": float(np.mean(acc)), "std": float(np.std(acc)), "runs": len(acc)}
                for shots, acc in sorted(by_shots.items())
            }
        return table

    def best(self) -> MethodRun:
        """The method with the best mean accuracy at the largest shot count (zero-shot compared as it is), as its
        first seed's run there."""
        summary = self.summary()
        largest = max(run.shots for run in self.runs)

        def mean_at_largest(method: str) -> float:
            rows = summary[method]
            return rows[largest]["mean"] if largest in rows else rows[max(rows)]["mean"]

        method = max(summary, key=mean_at_largest)
        return next(run for run in self.runs if run.method == method and run.shots in (largest, 0))


def accuracy(head: LinearHead, embeddings: torch.Tensor, labels: np.ndarray) -> float:
    return float((head.predict(embeddings).numpy() == labels).mean())


def run_fewshot(
    loaded: TorchEncoder,
    train: LabelledSplit,
    evaluation: LabelledSplit,
    settings: FewShotSettings,
    *,
    keep_largest: bool = False,
    log: Callable[[str], None] = print,
) -> FewShotResults:
    """Run every method of ``settings`` over its shot counts and seeds.

    Args:
        loaded: The checkpoint on PyTorch (a runtime's ``encoder``; its weights are restored after each
            SetFit run).
        train: The split the shots are drawn from.
        evaluation: The split accuracy is measured on.
        settings: Methods, shot counts, seeds and their settings.
        keep_largest: Keep the classifiers of the largest shot count's first seed (and zero-shot's).
        log: Where progress lines go.

    Raises:
        ValueError: when a shot count exceeds a class's images, or the evaluation split has no usable image.
    """
    check_shot_counts(train, settings.shot_counts)
    tower = loaded.image_tower.eval()
    spec = loaded.spec
    decoded = decode_rows(
        evaluation.source,
        range(len(evaluation)),
        spec,
        batch_size=settings.batch_size,
        num_workers=settings.num_workers,
    )
    eval_rows = sorted(decoded.images)
    if not eval_rows:
        raise ConfigError(f"{evaluation.source.name}: no usable image ({len(decoded.bad)} do not decode)")
    eval_images, eval_labels = decoded.stacked(eval_rows), evaluation.labels[eval_rows]
    eval_embeddings = embed_images(tower, eval_images, settings.batch_size)
    num_classes = len(train.class_names)
    runs: list[MethodRun] = []
    kept: dict[tuple[str, int, int], KeptClassifier] = {}
    largest, first_seed = max(settings.shot_counts), settings.seeds[0]

    def keeps(shots: int, seed: int) -> bool:
        return keep_largest and seed == first_seed and shots in (0, largest)

    def record(run: MethodRun, head: LinearHead, weights: WeightSnapshot | None = None) -> None:
        runs.append(run)
        log(f"{run.method:>12}  shots {run.shots:>3}  seed {run.seed}  accuracy {run.accuracy:.3f}  ({run.head})")
        if keeps(run.shots, run.seed):
            kept[(run.method, run.shots, run.seed)] = KeptClassifier(run, head, weights)

    anchor = None
    if "zeroshot" in settings.methods or ("setfit" in settings.methods and settings.anchor_setfit_head):
        started = time.perf_counter()
        with torch.no_grad():
            anchor = zeroshot_head(
                class_embeddings(loaded.encode_texts, train.class_names, settings.templates),
                model_scale(loaded.model),
            )
        if "zeroshot" in settings.methods:
            seconds = time.perf_counter() - started
            templates = f"{len(settings.templates)} templates"
            record(
                MethodRun(
                    "zeroshot", 0, first_seed, accuracy(anchor, eval_embeddings, eval_labels), templates, seconds
                ),
                anchor,
            )

    sampler = ShotSampler(train, spec, batch_size=settings.batch_size, num_workers=settings.num_workers)
    parameters = snapshot = None
    if "setfit" in settings.methods:
        parameters = image_parameters(tower, select_images(eval_images, slice(0, 1)))
        snapshot = WeightSnapshot(parameters)
    bar = tqdm(total=len(settings.seeds) * len(settings.shot_counts), desc="fewshot", unit="draw", leave=False)
    for seed in settings.seeds:
        for shots in settings.shot_counts:
            bar.update()
            drawn = sampler.draw(shots, seed)
            if "linear_probe" in settings.methods:
                started = time.perf_counter()
                embeddings = embed_images(tower, drawn.images, settings.batch_size)
                head, name = choose_head(
                    embeddings, drawn.labels, logistic_candidates(num_classes), logistic_name(DEFAULT_C), seed
                )
                seconds = time.perf_counter() - started
                record(
                    MethodRun("linear_probe", shots, seed, accuracy(head, eval_embeddings, eval_labels), name, seconds),
                    head,
                )
            if "setfit" in settings.methods:
                assert parameters is not None and snapshot is not None
                started = time.perf_counter()
                tune_image_tower(tower, parameters, drawn.images, drawn.labels, settings.setfit, seed * 1000 + shots)
                embeddings = embed_images(tower, drawn.images, settings.batch_size)
                tuned_eval = embed_images(tower, eval_images, settings.batch_size)
                candidates = logistic_candidates(num_classes)
                fallback = logistic_name(DEFAULT_C)
                if anchor is not None and settings.anchor_setfit_head:
                    candidates.update(anchored_candidates(anchor))
                    fallback = anchored_name(DEFAULT_ANCHOR_STRENGTH)
                head, name = choose_head(embeddings, drawn.labels, candidates, fallback, seed)
                seconds = time.perf_counter() - started
                weights = WeightSnapshot(parameters) if keeps(shots, seed) else None
                record(
                    MethodRun("setfit", shots, seed, accuracy(head, tuned_eval, eval_labels), name, seconds),
                    head,
                    weights,
                )
                snapshot.restore()
    bad = [{"id": b.id, "reason": b.reason} for b in [*decoded.bad.values(), *sampler.bad_samples]]
    bar.close()
    return FewShotResults(runs, kept, len(eval_rows), bad)
