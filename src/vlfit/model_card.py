"""The ``README.md`` model card of a saved model folder, as Trainer-based scripts write one.

A card is the hub's YAML metadata header (``library_name``, ``license``, ``base_model``, ``tags``, ``datasets``,
``pipeline_tag``) and a body: what the model was made from (a checkpoint or a preset), on which data, its final
metrics, the command line that made it, the versions, and how plain transformers loads it and embeds captions and
images as vlfit did. The first sentence says what the model is: a fine-tuning of a checkpoint, a preset trained from
scratch, a checkpoint's weights unchanged (a few-shot classifier's linear probe) or a WiSE-FT mix of two models (both
named, with alpha; the hub's ``base_model_relation: merge``). As the Trainer does, ``base_model`` and ``datasets``
in the header name hub repositories only: a local folder, or a name the hub refuses as a repository id
(``huggingface_hub``'s ``validate_repo_id``: ``--``, ``..``, a ``.git`` end, over 96 characters), is named in the
body, never in the metadata (the hub reads those keys as repository ids). The card is a ``huggingface_hub``
``ModelCard`` whose header is a ``ModelCardData`` (tags without repeats, no empty keys), written offline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from vlfit.atomic_files import write_text_atomically

MODEL_CARD_FILE = "README.md"
_HEADER_ORDER = ["library_name", "license", "base_model", "base_model_relation", "tags", "datasets", "pipeline_tag"]


@dataclass(frozen=True)
class WiseFtMix:
    """A WiSE-FT mix: the weights are ``(1 - alpha) x zeroshot_model + alpha x finetuned_model``.

    Attributes:
        alpha: The fine-tuned model's weight.
        zeroshot_model: The model before fine-tuning (hub id or folder); None: the run's own starting weights
            (``base_model`` or ``preset`` of the card).
        finetuned_model: The fine-tuned model (hub id or folder); None: the run's own fine-tuning of its start
            (``vlfit train --wise_ft_alpha``), whose checkpoints hold the unmixed weights.
    """

    alpha: float
    zeroshot_model: str | None = None
    finetuned_model: str | None = None


# What each ``vlfit merge`` method makes of its runs, as the card's first sentence says it.
_MERGE_METHODS = {
    "uniform": "a uniform soup (the mean of their weights)",
    "greedy": "a greedy soup (the mean of the runs kept, in order of their validation score, while the soup's "
    "validation score did not drop)",
    "stock": "a Model Stock merge (per layer, their mean pulled towards the base by the angle between their changes)",
}


@dataclass(frozen=True)
class MergedRuns:
    """Weights merged from fine-tuned runs (``vlfit merge``: model soups, Model Stock).

    Attributes:
        method: ``uniform``, ``greedy`` or ``stock``.
        runs: The runs merged (hub ids or folders), in the order merged.
        base: The model the runs were fine-tuned from, when known.
    """

    method: str
    runs: tuple[str, ...]
    base: str | None = None


@dataclass(frozen=True)
class _FamilyUsage:
    """How plain transformers loads and embeds with one family."""

    title: str
    model_class: str
    pipeline_tag: str | None
    embed: str  # the code after ``model`` and ``processor`` are loaded, with ``texts`` and ``images`` given


_DUAL_ENCODER_EMBED = """\
text_inputs = processor(text=texts, {padding}, truncation=True, return_tensors="pt")  # cut where the run cut
image_inputs = processor(images=images, return_tensors="pt")
with torch.no_grad():
    text_embeds = model.get_text_features(**text_inputs).pooler_output
    image_embeds = model.get_image_features(**image_inputs).pooler_output
text_embeds = torch.nn.functional.normalize(text_embeds, dim=-1)  # vlfit's retrieval embeddings
image_embeds = torch.nn.functional.normalize(image_embeds, dim=-1)
similarity = text_embeds @ image_embeds.T"""

_USAGE: dict[str, _FamilyUsage] = {
    "bridgetower": _FamilyUsage(
        "BridgeTower",
        "BridgeTowerForContrastiveLearning",
        None,  # transformers has no pipeline for BridgeTower's contrastive head
        """\
# as many texts as images; captions cut where the run cut them
inputs = processor(images=images, text=texts, padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    outputs = model(**inputs)
text_embeds, image_embeds = outputs.text_embeds, outputs.image_embeds  # L2-normalized, as vlfit's
similarity = text_embeds @ image_embeds.T""",
    ),
    "clip": _FamilyUsage(
        "CLIP", "CLIPModel", "zero-shot-image-classification", _DUAL_ENCODER_EMBED.format(padding="padding=True")
    ),
    "metaclip2": _FamilyUsage(
        "MetaCLIP 2",
        "MetaClip2Model",
        "zero-shot-image-classification",
        _DUAL_ENCODER_EMBED.format(padding="padding=True"),
    ),
    "siglip": _FamilyUsage(
        "SigLIP",
        "SiglipModel",
        "zero-shot-image-classification",
        # SigLIP was trained on captions padded to its positions without a mask; the saved tokenizer returns none.
        _DUAL_ENCODER_EMBED.format(padding='padding="max_length"'),
    ),
}


def _is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_ids(names: Sequence[str]) -> list[str]:
    """The names that can be hub repositories (as the hub's own id rules say): not local paths."""
    return [name for name in names if _is_hub_id(name) and not os.path.exists(name)]


def _base_models(base_model: str | None, mix: WiseFtMix | None, merged: MergedRuns | None = None) -> list[str]:
    """The models this one was made from: the runs merged, a mix's two endpoints, or its base."""
    if merged is not None:
        return list(merged.runs)
    if mix is not None and mix.finetuned_model is not None:
        return [name for name in (mix.zeroshot_model or base_model, mix.finetuned_model) if name]
    return [base_model] if base_model else []


def _metadata(
    family_name: str,
    base_model: str | None,
    datasets: Sequence[str],
    license: str,
    adapters: bool,
    mix: WiseFtMix | None,
    merged_runs: MergedRuns | None = None,
) -> ModelCardData:
    usage = _USAGE.get(family_name)
    metadata: dict[str, Any] = {"library_name": "peft" if adapters else "transformers", "license": license}
    bases = _hub_ids(_base_models(base_model, mix, merged_runs))
    merged = (mix is not None and mix.finetuned_model is not None) or merged_runs is not None
    if bases:
        metadata["base_model"] = bases if merged else bases[0]
        if merged:
            metadata["base_model_relation"] = "merge"  # the hub's word for weights mixed from its base models
    tags = ["lora"] if adapters else []
    tags += ["wise-ft"] if mix is not None else []
    tags += [{"stock": "model-stock"}.get(merged_runs.method, "model-soup")] if merged_runs is not None else []
    metadata["tags"] = ["vlfit", family_name, *tags]
    hub_datasets = _hub_ids(datasets)
    if hub_datasets:
        metadata["datasets"] = hub_datasets
    if usage is not None and usage.pipeline_tag is not None:
        metadata["pipeline_tag"] = usage.pipeline_tag
    return ModelCardData(**metadata)


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _metrics_table(metrics: Mapping[str, Any]) -> str:
    if not metrics:
        return "No metrics were recorded.\n"
    rows = [f"| {name} | {_format_value(value)} |" for name, value in metrics.items()]
    return "\n".join(["| Metric | Value |", "| --- | --- |", *rows]) + "\n"


def _model_name(name: str) -> str:
    """A model in the card's text: a hub id as a link, a folder in code quotes."""
    return f"[{name}](https://huggingface.co/{name})" if _hub_ids([name]) else f"`{name}`"


def _on(datasets: Sequence[str]) -> str:
    named = ", ".join(f"`{name}`" for name in datasets)
    return f"`{datasets[0]}`" if len(datasets) == 1 else f"the datasets {named}"


def _mix_origin(
    family_title: str, base_model: str | None, preset: str | None, datasets: Sequence[str], mix: WiseFtMix
) -> str:
    a = mix.alpha
    zeroshot = mix.zeroshot_model or base_model
    if mix.finetuned_model is not None:
        return (
            f"This {family_title} model is a WiSE-FT mix of two models, a fine-tuning of neither: its weights are "
            f"(1 - {a:g}) x the zero-shot model {_model_name(zeroshot) if zeroshot else 'named below'} + {a:g} x "
            f"the fine-tuned model {_model_name(mix.finetuned_model)} (alpha {a:g}; alpha 0 is the zero-shot "
            "model, alpha 1 the fine-tuned one)."
        )
    if zeroshot:
        start = f"the starting model {_model_name(zeroshot)}"
    else:
        start = f"the random initialization of vlfit's `{preset}` preset" if preset else "the starting weights"
    tuned = f"its fine-tuning on {_on(datasets)}" if datasets else "its fine-tuning"
    return (
        f"This {family_title} model is a WiSE-FT mix: its weights are (1 - {a:g}) x {start} + {a:g} x {tuned} by "
        f"the run below (alpha {a:g}; that run's checkpoints hold the unmixed fine-tuned weights). Its training "
        "metrics are the fine-tuning's; its evaluation metrics are the mix's."
    )


def _merged_origin(family_title: str, merged: MergedRuns) -> str:
    runs = ", ".join(_model_name(run) for run in merged.runs)
    base = f", all fine-tuned from {_model_name(merged.base)}" if merged.base else ""
    count = "one fine-tuned run" if len(merged.runs) == 1 else f"{len(merged.runs)} fine-tuned runs"
    return (
        f"This {family_title} model is {_MERGE_METHODS.get(merged.method, merged.method)} of {count} ({runs}){base}, "
        "made without training."
    )


def _origin(
    family_title: str,
    base_model: str | None,
    preset: str | None,
    datasets: Sequence[str],
    *,
    fine_tuned: bool = True,
    mix: WiseFtMix | None = None,
    merged: MergedRuns | None = None,
) -> str:
    if merged is not None:
        return _merged_origin(family_title, merged)
    if mix is not None:
        return _mix_origin(family_title, base_model, preset, datasets, mix)
    if base_model and not fine_tuned:
        return f"This {family_title} model holds the weights of {_model_name(base_model)}, unchanged."
    if base_model:
        origin = f"This {family_title} model is a fine-tuned version of {_model_name(base_model)}"
    elif preset:
        origin = f"This {family_title} model was trained from scratch, starting from vlfit's `{preset}` preset"
        origin += " (random initialization)"
    else:
        origin = f"This {family_title} model was trained from scratch"
    if datasets:
        origin += f", on {_on(datasets)}"
    return origin + "."


def _usage_section(family_name: str, folder_name: str, base_model: str | None, adapters: bool) -> str:
    usage = _USAGE.get(family_name)
    model_class = usage.model_class if usage else "AutoModel"
    lines = ["import torch", "from PIL import Image"]
    if adapters:
        base = base_model or f"{folder_name}/base_model"
        lines += [
            "from peft import PeftModel",
            f"from transformers import AutoProcessor, {model_class}",
            "",
            f'path = "{folder_name}"  # this folder (LoRA adapters), or its hub id',
            f'model = PeftModel.from_pretrained({model_class}.from_pretrained("{base}"), path).merge_and_unload()',
        ]
    else:
        lines += [
            f"from transformers import AutoProcessor, {model_class}",
            "",
            f'path = "{folder_name}"  # this folder, or its hub id',
            f"model = {model_class}.from_pretrained(path).eval()",
        ]
    lines += [
        "processor = AutoProcessor.from_pretrained(path)",
        "",
        'texts = ["a caption", "another caption"]',
        'images = [Image.open("first.jpg").convert("RGB"), Image.open("second.jpg").convert("RGB")]',
    ]
    embed = usage.embed if usage else "inputs = processor(text=texts, images=images, padding=True, return_tensors='pt')"
    text = "## How to use it with transformers\n\n"
    if adapters:
        text += (
            "This folder holds LoRA adapters. `vlfit merge-lora --model_name_or_path <this folder> --output_dir "
            "<merged>` writes a plain checkpoint; peft merges them in memory:\n\n"
        )
    else:
        text += "The folder loads in plain transformers, which embeds captions and images as vlfit does:\n\n"
    return text + "```python\n" + "\n".join(lines) + "\n" + embed + "\n```\n"


_VQA_USAGE = """\
## How to use it

A BridgeTower model fine-tuned to answer questions about images (`vlfit train --task vqa`): the fused tower
(`bridgetower.*`, transformers' `BridgeTowerModel`) and the BridgeTower paper's VQA classifier over its pooled output
(`vqa_classifier.*`: `Linear(2h, 4h) -> LayerNorm -> GELU -> Linear(4h, answers)`, `h` the config's `hidden_size`),
trained with binary cross-entropy on soft targets (`min(1, annotators / 3)`). The config's `id2label` lists the
{answers} answers in output order. In vlfit:

```python
import vlfit

model = vlfit.load("{folder}")
model.answer(["photo.jpg"], ["how many dogs are there?"], top_k=3)  # [[(answer, score), ...]]
```

or `vlfit vqa --model {folder} photo.jpg "how many dogs are there?"`. transformers has no BridgeTower VQA class:
it loads the backbone, and the head is four modules rebuilt from the config:

```python
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoProcessor, BridgeTowerModel

path = "{folder}"  # this folder
config = AutoConfig.from_pretrained(path)
backbone = BridgeTowerModel.from_pretrained(path).eval()  # pooler_output: [B, 2h]
processor = AutoProcessor.from_pretrained(path)
h = config.hidden_size
head = torch.nn.Sequential(
    torch.nn.Linear(2 * h, 4 * h), torch.nn.LayerNorm(4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, config.num_labels)
)
weights = load_file(f"{{path}}/model.safetensors")
head.load_state_dict({{k.removeprefix("vqa_classifier."): v for k, v in weights.items() if k.startswith("vqa_")}})
head.eval()

inputs = processor(images=[Image.open("photo.jpg").convert("RGB")], text=["how many dogs are there?"],
                   return_tensors="pt")
with torch.no_grad():
    scores = head(backbone(**inputs).pooler_output).sigmoid()[0]  # one score per answer
top = scores.topk(3)
print([(config.id2label[int(i)], float(s)) for s, i in zip(top.values, top.indices)])
```
"""


def write_model_card(
    output_dir: str,
    *,
    family_name: str,
    base_model: str | None,
    preset: str | None,
    datasets: Sequence[str],
    metrics: Mapping[str, Any] | None,
    command_line: str | None,
    how_made: str | None = None,
    license: str = "other",
    adapters: bool = False,
    fine_tuned: bool = True,
    mix: WiseFtMix | None = None,
    answers: Sequence[str] | None = None,
    merged: MergedRuns | None = None,
) -> str:
    """Write ``output_dir/README.md``, the model card of a saved model folder (replacing one already there).

    Args:
        output_dir: The model folder.
        family_name: The model family's ``name`` (``bridgetower``, ``clip``, ``siglip``).
        base_model: The checkpoint (hub id or folder) the model was made from; None for a preset.
        preset: The preset a model trained from scratch started from; None for a checkpoint.
        datasets: The training data (hub ids or local paths): data the model was only evaluated on is not named
            here (``how_made`` can say so).
        metrics: The final metrics (a table of the card); None or empty: none recorded.
        command_line: The command that made the folder; None when not known.
        how_made: A sentence or two more on how the model was made (merged adapters, a few-shot head, ...).
        license: The license's hub identifier (``apache-2.0``, ``mit``, ...; ``other`` when not known).
        adapters: The folder holds LoRA adapters, not a whole model (loaded through peft).
        fine_tuned: False: the weights are ``base_model``'s, unchanged (a few-shot classifier's linear probe).
        mix: The weights are a WiSE-FT mix (``WiseFtMix``): the card names both endpoints and alpha, and lists the
            endpoints that are hub repositories as ``base_model`` with ``base_model_relation: merge``.
        answers: The answers of a question-answering model (``vlfit train --task vqa``), in output order: the card
            shows how to ask it; None for a model that embeds.
        merged: The weights are merged from fine-tuned runs (``MergedRuns``: a soup, Model Stock): the card names
            the method and the runs, and lists those that are hub repositories as ``base_model`` with
            ``base_model_relation: merge``.

    Returns:
        The card's path.
    """
    usage = _USAGE.get(family_name)
    title = usage.title if usage else family_name
    folder_name = os.path.basename(os.path.abspath(output_dir))
    datasets = list(datasets)
    metadata = _metadata(family_name, base_model, datasets, license, adapters, mix, merged)
    header = metadata.to_yaml(original_order=_HEADER_ORDER)
    origin = _origin(title, base_model, preset, datasets, fine_tuned=fine_tuned, mix=mix, merged=merged)
    bases = _base_models(base_model, mix, merged)
    parts = [
        f"# {folder_name}\n",
        origin + (f" {how_made.strip()}" if how_made else "") + "\n",
        "## Results\n",
        _metrics_table(metrics or {}),
        "## How it was made\n",
        f"```bash\n{command_line}\n```\n" if command_line else "The command line was not recorded.\n",
        "".join(f"- {package} {_version_of(package)}\n" for package in ("vlfit", "transformers", "torch")),
        _VQA_USAGE.format(folder=folder_name, answers=len(answers))
        if answers is not None
        else _usage_section(family_name, folder_name, base_model, adapters),
        "## License\n",
        f"`{license}`" + (_see_licenses(len(bases)) if license == "other" else "") + "\n",
    ]
    # Parsed back as the hub parses a card: a header that is not hub metadata fails here, not on the hub.
    card = ModelCard(f"---\n{header}\n---\n\n" + "\n".join(parts))
    path = os.path.join(output_dir, MODEL_CARD_FILE)
    os.makedirs(output_dir, exist_ok=True)
    write_text_atomically(path, str(card))
    return path


def _see_licenses(base_models: int) -> str:
    if not base_models:
        return ""
    return " (see the base model's license)" if base_models == 1 else " (see the base models' licenses)"


def _version_of(package: str) -> str:
    """The installed version of ``package`` (vlfit's own from ``vlfit.version``, also in a source checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    if package == "vlfit":
        from vlfit.version import __version__

        return __version__
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
