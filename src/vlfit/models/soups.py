"""Merging fine-tuned runs of one base in weight space: model soups (Wortsman et al. 2022) and Model Stock (Jang et
al. 2024). ``vlfit merge`` and ``vlfit search --soup`` build on these; WiSE-FT's two-model mix is
``vlfit.models.interpolation.interpolate``.

- **uniform**: the mean of the runs' weights.
- **greedy**: the runs in order of their held-out score, each added to the soup (a uniform soup of those kept) only
  when the soup's score does not drop; the first is the best run, so the soup scores at least as well as it on the
  data that chose it. ``greedy_soup`` takes the scoring as a function: evaluation lives above this layer.
- **stock**: for each tensor, ``cos`` is the mean pairwise cosine between the runs' changes from the base
  (``w_i - w_base``), ``t = N cos / (1 + (N - 1) cos)`` and the merge ``t * mean(w_i) + (1 - t) * w_base``: the more
  the runs agree, the closer to their mean. ``cos`` is clipped to ``[0, 1]`` (the paper's runs agree, cos > 0; a
  negative one would put ``t`` below 0 or divide by 0 at ``cos = -1 / (N - 1)``), so ``t`` is in ``[0, 1]``.

Every floating-point tensor is merged in float32 and cast back; tensors that are not floating point (position ids)
must be equal in every run. ``load_ingredients`` loads the runs (LoRA adapters merged into their base first) and
refuses, in one line naming the run and what differs, runs that cannot be merged: another family, a tokenizer with
another vocabulary, another set of tensors or shapes, other input settings (caption length, image size, mean, std,
NaFlex patch budget), another recorded base, or adapters whose base is not there to merge them into.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import torch

from vlfit.errors import ConfigError, MissingFileError, ModelLoadError
from vlfit.models.family import InputSpec
from vlfit.models.loading import LoadedModel, load_model
from vlfit.models.reference import parse_model_reference

logger = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]
# What vlfit train records of a run's flags when it starts (vlfit.training.output_dir.RUN_FLAGS_FILE).
RUN_FLAGS_FILE = "run_flags.json"


# ------------------------------------------------------------------------------------------------ the weights


def uniform_soup(runs: Sequence[Mapping[str, torch.Tensor]]) -> Weights:
    """The mean of the runs' floating-point tensors (in float32, cast back); other tensors are the first run's."""
    if not runs:
        raise ConfigError("a soup needs at least one run")
    first = runs[0]
    soup = {}
    for name, tensor in first.items():
        if not tensor.is_floating_point() or len(runs) == 1:
            soup[name] = tensor.clone()
            continue
        total = torch.zeros(tensor.shape, dtype=torch.float32)
        for run in runs:
            total += run[name].float()
        soup[name] = (total / len(runs)).to(tensor.dtype)
    return soup


def stock_ratio(cos: float, runs: int) -> float:
    """Model Stock's interpolation ratio ``t = N cos / (1 + (N - 1) cos)`` for ``runs`` = N, ``cos`` clipped to
    ``[0, 1]``: 0 for orthogonal changes (the merge is the base), 1 for identical ones (the runs' mean)."""
    cos = min(max(float(cos), 0.0), 1.0)
    return runs * cos / (1.0 + (runs - 1) * cos)


def mean_pairwise_cosine(deltas: Sequence[torch.Tensor]) -> float:
    """The mean cosine between every pair of ``deltas`` (flattened); a pair with a zero change counts as 0."""
    flat = [delta.flatten().float() for delta in deltas]
    cosines = []
    for a, b in combinations(flat, 2):
        norms = a.norm() * b.norm()
        cosines.append(float(a @ b / norms) if norms > 0 else 0.0)
    return sum(cosines) / len(cosines)


def model_stock(
    base: Mapping[str, torch.Tensor], runs: Sequence[Mapping[str, torch.Tensor]]
) -> tuple[Weights, dict[str, float]]:
    """Model Stock's merge of two or more runs with their base, tensor by tensor (see the module's docstring).

    A tensor the base does not have (a head the fine-tuning added) has no change to measure: it is the runs' mean.

    Returns:
        The merged weights, and each floating-point tensor's ratio ``t`` (1 for those the base lacks).
    """
    if len(runs) < 2:
        raise ConfigError("Model Stock needs at least two fine-tuned runs (the angle between their changes)")
    mean = uniform_soup(runs)
    merged: Weights = {}
    ratios: dict[str, float] = {}
    for name, tensor in mean.items():
        if not tensor.is_floating_point():
            merged[name] = tensor
        elif name not in base:
            merged[name], ratios[name] = tensor, 1.0
        else:
            start = base[name].float()
            t = stock_ratio(mean_pairwise_cosine([run[name].float() - start for run in runs]), len(runs))
            merged[name] = torch.lerp(start, tensor.float(), t).to(tensor.dtype)
            ratios[name] = t
    return merged, ratios


@dataclass
class GreedyStep:
    """One run's turn in a greedy soup: its own score, the soup's score with it, and whether it stayed."""

    run: str
    score: float
    soup_score: float
    kept: bool


@dataclass
class GreedySoup:
    """A greedy soup: its weights, the runs kept (in order) and every step (``steps[0]`` is the best run alone)."""

    weights: Weights
    kept: list[str]
    steps: list[GreedyStep] = field(default_factory=list)

    @property
    def score(self) -> float:
        """The soup's score: the last kept step's."""
        return [step.soup_score for step in self.steps if step.kept][-1]


def greedy_soup(
    runs: Sequence[tuple[str, Mapping[str, torch.Tensor], float]],
    score: Callable[[str, Weights], float],
) -> GreedySoup:
    """The greedy soup of the model-soups paper: runs sorted by their held-out score (best first; ties keep the
    given order), each added only when the soup's score (``score(label, weights)``) does not drop.

    Args:
        runs: ``(name, weights, held-out score)`` of each run.
        score: Scores a candidate soup on the held-out data (higher is better); ``label`` says which candidate.
    """
    if not runs:
        raise ConfigError("a soup needs at least one run")
    ordered = sorted(runs, key=lambda run: -run[2])
    name, weights, best = ordered[0]
    kept_weights = [weights]
    soup = GreedySoup(dict(weights), [name], [GreedyStep(name, best, best, True)])
    current = best
    for number, (name, weights, own) in enumerate(ordered[1:], 2):
        candidate = uniform_soup([*kept_weights, weights])
        value = score(f"step {number} of {len(ordered)}: the soup of {len(kept_weights)} runs + {name}", candidate)
        kept = value >= current
        soup.steps.append(GreedyStep(name, own, value, kept))
        logger.info("greedy soup: %s %s (soup %.4f, before %.4f)", name, "kept" if kept else "left out", value,
                    current)  # fmt: skip
        if kept:
            kept_weights.append(weights)
            soup.weights, soup.kept, current = candidate, [*soup.kept, name], value
    return soup


# ------------------------------------------------------------------------------------------------ the runs


@dataclass
class Ingredient:
    """A run to merge, loaded.

    Attributes:
        name: The run as the user named it.
        loaded: The model (LoRA adapters merged into their base) and its spec.
        weights: Its state dict.
        base: What it was fine-tuned from, when recorded (an adapters folder's base, or ``run_flags.json``'s
            ``model_name_or_path``); None when not known.
    """

    name: str
    loaded: LoadedModel
    weights: Weights
    base: str | None


def _same_place(name: str) -> str:
    """A model's name to compare with another's: a local path resolved, a hub id as it is."""
    return os.path.realpath(name) if os.path.exists(name) else name


def recorded_base(name: str) -> str | None:
    """What the run ``name`` was fine-tuned from, when it says so: its adapters' base, or the
    ``model_name_or_path`` of its ``run_flags.json``."""
    reference = parse_model_reference(name, flag="--runs")
    if reference.kind == "adapters":
        return reference.base
    path = os.path.join(name, RUN_FLAGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            flags = json.load(f).get("flags", {})
    except (OSError, ValueError, AttributeError):
        return None
    base = flags.get("model_name_or_path") if isinstance(flags, dict) else None
    return str(base) if base else None


def load_ingredient(name: str, *, flag: str = "--runs", max_seq_length: int | None = None) -> Ingredient:
    """Load one run (adapters merged into their base first).

    Raises:
        ConfigError: a question-answering run, or adapters whose base is not there (a LoRA run not merged yet).
    """
    reference = parse_model_reference(name, flag=flag)
    if reference.answers_questions:
        raise ConfigError(f"{flag} {name} answers questions (vlfit train --task vqa): vlfit merge merges models that "
                          "embed")  # fmt: skip
    try:
        loaded = load_model(model_name_or_path=reference, max_seq_length=max_seq_length)
    except (MissingFileError, ModelLoadError, OSError):  # OSError: transformers' own, for a missing base
        if reference.kind != "adapters":
            raise
        raise ConfigError(
            f"{flag} {name} is a LoRA run not merged yet, and its base {reference.base} cannot be loaded to merge "
            "it into; run vlfit merge-lora on it where its base is, and merge that folder"
        ) from None
    weights = {key: tensor.detach() for key, tensor in loaded.model.state_dict().items()}
    return Ingredient(name, loaded, weights, recorded_base(name))


def check_mergeable(ingredients: Sequence[Ingredient], base: Ingredient | None = None, *, flag: str = "--runs") -> None:
    """Refuse, in one line naming the run and what differs, runs that cannot be merged with the first one (and
    with ``base``, which may lack tensors the runs added, e.g. a matching head).

    Raises:
        ConfigError: another family, vocabulary, set of tensors, shape, unequal non-float tensor, input settings or
            recorded base.
    """
    first = ingredients[0]
    for other in ingredients[1:]:
        _check_pair(first, other, f"{flag} {other.name}", f"{first.name}", exact=True)
    if base is not None:
        for run in ingredients:
            _check_pair(run, base, f"--base {base.name}", f"the run {run.name}", exact=False)
    recorded = {_same_place(run.base): run.name for run in ingredients if run.base}
    if base is not None and recorded and _same_place(base.name) not in recorded:
        start, run = next(iter(recorded.items()))
        raise ConfigError(f"--base {base.name}: the run {run} was fine-tuned from {start}, not from it; pass "
                          f"--base {start}")  # fmt: skip
    if len(recorded) > 1:
        (a, run_a), (b, run_b) = list(recorded.items())[:2]
        raise ConfigError(f"{flag} {run_b} was fine-tuned from {b} and {run_a} from {a}: merging needs runs of one "
                          "base")  # fmt: skip


def _check_pair(reference: Ingredient, other: Ingredient, named: str, against: str, *, exact: bool) -> None:
    """``other`` against ``reference`` (``exact``: the same tensors; else ``other`` may lack some)."""
    family, other_family = reference.loaded.family.name, other.loaded.family.name
    if family != other_family:
        raise ConfigError(f"{named} is a {other_family} model and {against} a {family} one: merging needs one "
                          "architecture")  # fmt: skip
    vocab, other_vocab = reference.loaded.tokenizer.get_vocab(), other.loaded.tokenizer.get_vocab()
    if vocab != other_vocab:
        ours, theirs = reference.loaded.inputs.max_seq_length, other.loaded.inputs.max_seq_length
        also = f"; its caption length differs too ({theirs}, {ours} there)" if ours != theirs else ""
        difference = _vocabulary_difference(other_vocab, vocab)
        raise ConfigError(f"{named}: its tokenizer's vocabulary differs from that of {against} ({difference}){also}: "
                          "merging needs one tokenizer")  # fmt: skip
    missing = sorted(set(other.weights) - set(reference.weights))
    extra = sorted(set(reference.weights) - set(other.weights)) if exact else []
    if missing or extra:
        name, how = (missing[0], "is in it and not in") if missing else (extra[0], "is missing from it but in")
        raise ConfigError(f"{named}: the tensor {name!r} {how} {against} ({len(missing) + len(extra)} differ): "
                          "merging needs one architecture")  # fmt: skip
    for name, tensor in other.weights.items():
        mine = reference.weights[name]
        if tensor.shape != mine.shape:
            raise ConfigError(f"{named}: {name!r} has shape {tuple(tensor.shape)} there and {tuple(mine.shape)} in "
                              f"{against}: merging needs one architecture")  # fmt: skip
        if not tensor.is_floating_point() and not torch.equal(tensor, mine):
            raise ConfigError(f"{named}: {name!r} differs from {against}'s and cannot be averaged")
    ours, theirs = _input_spec(reference.loaded.inputs), _input_spec(other.loaded.inputs)
    for key, value in theirs.items():
        if value != ours[key]:
            remedy = "merging needs runs of one input spec"
            if key == "max_seq_length":
                remedy = "pass --max_seq_length to merge them at one caption length"
            raise ConfigError(f"{named} was trained with {key} {value}, {against} with {ours[key]}: {remedy}")


def _vocabulary_difference(theirs: Mapping[str, int], ours: Mapping[str, int]) -> str:
    """What differs between two vocabularies (token -> id), in words: the sizes, or a token that one has and the
    other has not (or has under another id), and how many do."""
    only_theirs, only_ours = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    moved = sorted(token for token in set(theirs) & set(ours) if theirs[token] != ours[token])
    count = len(only_theirs) + len(only_ours) + len(moved)
    if only_theirs:
        first = f"{only_theirs[0]!r} is in it and not there"
    elif only_ours:
        first = f"{only_ours[0]!r} is there and not in it"
    else:
        first = f"{moved[0]!r} is token {theirs[moved[0]]} in it and {ours[moved[0]]} there"
    sizes = f"{len(theirs)} tokens, {len(ours)} there" if len(theirs) != len(ours) else f"both {len(ours)} tokens"
    return f"{sizes}; {first}; {count} tokens differ"


def _input_spec(inputs: InputSpec) -> dict[str, Any]:
    """What two runs' inputs must agree on to be merged, named as ``input_spec.json`` names it."""
    return {"max_seq_length": inputs.max_seq_length, "image_size": inputs.image_size,
            "image_mean": [round(float(x), 6) for x in inputs.image_mean],
            "image_std": [round(float(x), 6) for x in inputs.image_std],
            "max_num_patches": inputs.max_num_patches}  # fmt: skip


def load_ingredients(
    runs: Sequence[str], base: str | None = None, *, max_seq_length: int | None = None
) -> tuple[list[Ingredient], Ingredient | None]:
    """Load and check the runs (``--runs``) and the base (``--base``) of a merge."""
    if not runs:
        raise ConfigError("--runs: name at least one run to merge (or --search_dir)")
    if len({_same_place(run) for run in runs}) < len(runs):
        raise ConfigError(f"--runs names a run twice ({', '.join(runs)}): each run is an ingredient once")
    ingredients = [load_ingredient(run, max_seq_length=max_seq_length) for run in runs]
    start = load_ingredient(base, flag="--base", max_seq_length=max_seq_length) if base else None
    check_mergeable(ingredients, start)
    return ingredients, start
