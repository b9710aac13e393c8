"""What a user names as a model, parsed once: a preset, a checkpoint folder, LoRA adapters, an export folder or a
hub id.

``parse_model_reference`` is the only code that looks at a model path to decide what it is; every command,
``vlfit.load`` and ``vlfit serve`` pass what they were given through it and act on the ``ModelReference`` it
returns (``vlfit.models.loading`` loads a preset, a checkpoint, adapters or a hub id; ``vlfit.inference.backends``
runs a checkpoint or an export folder). Nothing here imports torch or transformers.

The kinds, and how a folder is told apart:

- ``preset``: a preset's name (``list_presets``) that is not also a path, or a preset ``.json`` file.
- ``export``: a folder ``vlfit export`` wrote: it holds ``export_manifest.json`` (read by
  ``vlfit.inference.exported``).
- ``adapters``: a folder of LoRA adapters a run saved (``adapter_config.json``); its ``base`` is the checkpoint they
  were trained on. Adapters of a VQA run also hold the model's ``config.json`` (its answers, which the base's config
  does not list): it is the model's config, and it says the adapters answer questions.
- ``checkpoint``: any other folder holding a model config (a training run's output or one of its ``checkpoint-N``
  folders), or an existing file, handed to transformers as it is; one whose config names ``VQA_ARCHITECTURE``
  answers questions (``answers_questions``) and has nothing to embed with.
- ``hub``: a name with a hub id's form and nothing local by that name.

A folder with no model config is refused, naming what it is and the command that takes it (``folder_kind``, the
one place that names a folder, for ``--dataset_name`` and ``--index`` too): an index, a data folder, a folder of
images, a run whose final model is not saved yet.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from vlfit.errors import ConfigError, MissingFileError
from vlfit.models.presets import get_preset, is_preset_file, list_presets

KINDS = ("preset", "checkpoint", "adapters", "export", "hub")
# What a flag naming a model to load with transformers takes (--model_name_or_path, --zeroshot_model ...).
LOADABLE = ("checkpoint", "adapters", "hub")
# The file that marks a folder vlfit export wrote (its layout: vlfit.inference.exported).
EXPORT_MANIFEST = "export_manifest.json"
# The file peft's save_pretrained writes beside LoRA adapters (vlfit.models.lora).
ADAPTER_CONFIG = "adapter_config.json"
# A transformers model's config file (transformers.utils.CONFIG_NAME).
MODEL_CONFIG = "config.json"
# What the config of a folder vlfit train --task vqa wrote names in its architectures (vlfit.models.vqa).
VQA_ARCHITECTURE = "BridgeTowerForQuestionAnswering"
# The manifest of an index vlfit retrieve index wrote (vlfit.index.manifest.MANIFEST_NAME).
INDEX_MANIFEST = "index_manifest.json"
# The files an image folder's images are (vlfit.data.sources.images reads them).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# What a data folder holds and a model folder does not: datasets' save_to_disk files, and the data files
# vlfit reads (not .json or .jsonl: a model folder and a run folder hold those too).
_DATA_MARKERS = frozenset({"dataset_dict.json", "dataset_info.json", "state.json"})
_DATA_EXTENSIONS = frozenset({".parquet", ".arrow", ".csv", ".tar"})


@dataclass(frozen=True)
class ModelReference:
    """A model as the user named it, and what kind of thing that name is.

    Attributes:
        kind: ``preset``, ``checkpoint``, ``adapters``, ``export`` or ``hub``.
        path: The preset's name or file, the folder, or the hub id, as given.
        base: For adapters, the checkpoint they were trained on (``base_model_name_or_path``, resolved against the
            folder when relative); None otherwise.
        answers_questions: A checkpoint of a question-answering model (``vlfit train --task vqa``: its config
            names ``VQA_ARCHITECTURE``): it answers questions and has no contrastive heads to embed with.
    """

    kind: str
    path: str
    base: str | None = None
    answers_questions: bool = False

    @property
    def weights(self) -> str | None:
        """The folder or hub id whose weights load: the adapters' base, the checkpoint or hub id; None for a preset
        (random weights) or an export (graphs, not weights)."""
        if self.kind == "adapters":
            return self.base
        return self.path if self.kind in ("checkpoint", "hub") else None


def parse_model_reference(
    value: str | os.PathLike[str], *, flag: str = "--model_name_or_path", kinds: Collection[str] = LOADABLE
) -> ModelReference:
    """What ``value`` names, among the ``kinds`` the caller takes.

    Args:
        value: A preset's name or ``.json`` file, a folder, or a hub id.
        flag: The option that named it, for error messages.
        kinds: What the caller can use; ``("preset",)`` alone reads ``value`` as a preset whatever it looks like
            (``--model_preset``).

    Raises:
        MissingFileError: naming ``flag`` and what it could have named, when nothing is there (a name that can
            only be a local path, or any name when ``hub`` is not among ``kinds``).
        ConfigError: for ``kinds=("preset",)``, an unknown preset or a file that is not one; a preset's name where
            ``kinds`` takes no preset; a folder of data.
    """
    name = os.fspath(value)
    if tuple(kinds) == ("preset",):
        get_preset(name)  # an unknown name or a bad file fails here, naming --model_preset
        return ModelReference("preset", name)
    if "preset" in kinds and (
        (is_preset_file(name) and os.path.isfile(name)) or (name in list_presets() and not os.path.exists(name))
    ):
        return ModelReference("preset", name)
    if os.path.isdir(name):
        if os.path.isfile(os.path.join(name, EXPORT_MANIFEST)):
            return ModelReference("export", name)
        if is_adapter_folder(name):
            base = adapter_base(name)
            answers = _answers_questions(name) or _answers_questions(base)  # their own config, else a local base's
            return ModelReference("adapters", name, base=base, answers_questions=answers)
        refuse_other_folder(name, flag, presets="preset" in kinds)
        return ModelReference("checkpoint", name, answers_questions=_answers_questions(name))
    if "hub" in kinds:
        if "preset" not in kinds and name in list_presets() and not os.path.exists(name):
            instead = f"; --model_preset {name} builds it with random weights" if flag == "--model_name_or_path" else ""
            raise ConfigError(
                f"{flag} {name}: a preset's name, not a trained model: {flag} takes a checkpoint folder (what vlfit "
                f"train writes) or a hub id{instead}"
            )
        check_local_path(name, flag)
        return ModelReference("checkpoint" if os.path.exists(name) else "hub", name)
    if "preset" in kinds and not os.path.exists(name):
        raise MissingFileError(
            f"{flag} {name}: no such model folder, and not a preset (one of: {', '.join(list_presets())}; or a "
            "preset .json file)"
        )
    what = "model" if "export" in kinds else "checkpoint"
    raise MissingFileError(f"{flag} {name}: no such {what} folder ({os.path.abspath(name)} does not exist)")


def refuse_other_folder(folder: str, flag: str, *, presets: bool = False) -> None:
    """Refuse a folder that holds no model config (``config.json``), naming what it is instead (``folder_kind``:
    an index, data, images, a run without its final model ...) and the command that takes it, rather than let
    transformers say "Unrecognized model".

    Args:
        folder: The folder named.
        flag: The option that named it.
        presets: Whether ``flag`` takes a preset's name too (the message offers them).

    Raises:
        ConfigError: naming ``flag``, what the folder is and what to pass instead.
    """
    found = folder_kind(folder)
    if found.kind == "model":
        return
    preset = f"a preset ({', '.join(list_presets()[:3])}, ...), " if presets else ""
    raise ConfigError(f"{flag} {folder}: {found.what}, not a model{found.use_after(': ')}; name a model with {flag}: "
                      f"{preset}a folder vlfit train wrote or a hub id")  # fmt: skip


@dataclass(frozen=True)
class FolderKind:
    """What a folder holds, as a refusal names it, and the command that takes it (``folder_kind``).

    Attributes:
        kind: ``model`` (a model config: a checkpoint), ``adapters``, ``export``, ``index``, ``run`` (a training
            run's folder holding checkpoints but no final model), ``data``, ``images`` or ``other``.
        path: The folder.
        sample: The file or folder, relative to ``path``, that shows it (data, images, a run's checkpoint).
    """

    kind: str
    path: str
    sample: str = ""

    @property
    def what(self) -> str:
        """What the folder is, in words: ``an index (vlfit retrieve index wrote it)``."""
        return {
            "model": f"a model (it holds {MODEL_CONFIG})",
            "adapters": "LoRA adapters (vlfit train --lora_target wrote them)",
            "export": "an export (vlfit export wrote it)",
            "index": "an index (vlfit retrieve index wrote it)",
            "run": f"a training run's folder without its final model (it holds {self.sample})",
            "data": f"a data folder (it holds {self.sample})",
            "images": f"a folder of images (it holds {self.sample})",
            "other": f"a folder with no model config ({MODEL_CONFIG}) in it" if self.sample else "an empty folder",
        }[self.kind]

    @property
    def use(self) -> str:
        """The command that takes the folder (empty for ``other``)."""
        path = self.path
        return {
            "model": f"give it as --model_name_or_path {path}",
            "adapters": f"give it as --model_name_or_path {path}",
            "export": f"give it as --model_name_or_path {path} to vlfit retrieve index, vlfit serve or vlfit.load",
            "index": f"search it with vlfit retrieve query --index {path}",
            "run": f"give its checkpoint: {os.path.join(path, self.sample.rstrip('/'))}",
            "data": f"pass it as --dataset_name {path}",
            "images": f"index it with vlfit retrieve index --images {path}",
            "other": "",
        }[self.kind]

    def use_after(self, separator: str) -> str:
        """``use`` after ``separator``, or nothing when no command takes the folder."""
        return separator + self.use if self.use else ""


def folder_kind(folder: str) -> FolderKind:
    """What ``folder`` is: the one place that looks inside a folder to name it, for every refusal of a folder given
    where another kind is taken (a model flag, ``--dataset_name``, ``--index``).

    Its own files decide first (a model config, adapters, an export's or an index's manifest); then the files of
    its subfolders one level down: a run's ``checkpoint-N`` with a model config, then data (datasets'
    ``save_to_disk`` files, parquet, csv, arrow or tar files; not ``.json``, which a model folder holds too), then
    image files.
    """
    names = sorted(os.listdir(folder))
    for marker, kind in ((MODEL_CONFIG, "model"), (ADAPTER_CONFIG, "adapters"), (EXPORT_MANIFEST, "export"),
                         (INDEX_MANIFEST, "index")):  # fmt: skip
        if marker in names:
            return FolderKind(kind, folder)
    folders = [name for name in names if not name.startswith(".") and os.path.isdir(os.path.join(folder, name))]
    checkpoints = [name for name in folders if re.fullmatch(r"checkpoint-\d+", name)]
    for name in sorted(checkpoints, key=lambda name: int(name.split("-")[1]), reverse=True):
        if os.path.isfile(os.path.join(folder, name, MODEL_CONFIG)):
            return FolderKind("run", folder, name + "/")
    for kind, matches in (("data", _is_data_file), ("images", is_image_file)):
        found = [name for name in names if matches(name)]
        for sub in folders if not found else ():
            found = [os.path.join(sub, name) for name in sorted(os.listdir(os.path.join(folder, sub))) if matches(name)]
            if found:
                break
        if found:
            return FolderKind(kind, folder, found[0])
    return FolderKind("other", folder, names[0] if names else "")


def check_index_folder(path: str) -> None:
    """Refuse an ``--index`` that is no index folder, saying what it is: nothing there, a file, or another kind of
    folder (a model, data, images: ``vlfit.models.reference.folder_kind``) and the command that takes it.

    Raises:
        MissingFileError: naming ``--index``, what the path is and how to build an index.
    """
    build = "build an index there first (vlfit retrieve index, or vlfit.Index.build from Python)"
    if not os.path.exists(path):
        raise MissingFileError(f"--index {path}: no such folder ({os.path.abspath(path)} does not exist); {build}")
    if not os.path.isdir(path):
        raise MissingFileError(f"--index {path}: a file, not an index folder; pass the folder vlfit retrieve index "
                               "wrote (its --output_dir)")  # fmt: skip
    if os.path.isfile(os.path.join(path, INDEX_MANIFEST)):
        return
    found = folder_kind(path)
    if found.kind == "other":
        holds = f"it holds {found.sample}" if found.sample else "an empty folder"
        raise MissingFileError(f"--index {path}: no {INDEX_MANIFEST} in it ({holds}); {build}")
    raise MissingFileError(f"--index {path}: {found.what}, not an index{found.use_after(': ')}")


def _is_data_file(name: str) -> bool:
    """Whether a file marks data rather than a model (none of these is written beside a model)."""
    return name in _DATA_MARKERS or os.path.splitext(name)[1].lower() in _DATA_EXTENSIONS


def is_image_file(name: str) -> bool:
    """Whether a file of a folder is an image vlfit reads (by its extension; hidden files are not)."""
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _config(folder: str) -> dict[str, Any]:
    """The model config in ``folder`` as a dict, or ``{}`` when it has none that reads (transformers refuses it
    later, naming it)."""
    try:
        with open(os.path.join(folder, MODEL_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _answers_questions(folder: str) -> bool:
    """Whether the checkpoint folder's config names the VQA architecture (a folder without a readable config is
    left for transformers to refuse)."""
    return VQA_ARCHITECTURE in (_config(folder).get("architectures") or ())


def local_model_type(reference: ModelReference) -> str | None:
    """The ``model_type`` of a local checkpoint's config (for adapters, their local base's): ``bridgetower``,
    ``clip``, ``siglip`` ...; None for a hub id, a preset, an export or a folder without a readable config."""
    folder = reference.weights
    if reference.kind not in ("checkpoint", "adapters") or not folder or not os.path.isdir(folder):
        return None
    model_type = _config(folder).get("model_type")
    return model_type if isinstance(model_type, str) else None


def two_towers(
    model_name_or_path: object, model_preset: object, vision: str | None, text: str | None, projection_dim: object
) -> tuple[str, str] | None:
    """The vision and text towers of a new two-tower model (``--vision_model_name_or_path``,
    ``--text_model_name_or_path``), or None when none is named.

    Raises:
        ConfigError: for one tower without the other, towers beside a checkpoint or preset, or a ``--projection_dim``
            without towers or below 1.
    """
    if vision is None and text is None:
        if projection_dim is not None:
            raise ConfigError(
                "--projection_dim sizes the projections of a model made of two towers (--vision_model_name_or_path "
                "and --text_model_name_or_path); a checkpoint or preset keeps its own"
            )
        return None
    if vision is None or text is None:
        missing = "--vision_model_name_or_path" if vision is None else "--text_model_name_or_path"
        raise ConfigError(f"a model of two towers needs both: pass {missing} too")
    if model_name_or_path is not None or model_preset is not None:
        raise ConfigError(
            "--vision_model_name_or_path and --text_model_name_or_path build a new model of two towers: drop "
            "--model_name_or_path / --model_preset (a run of such a model is loaded with --model_name_or_path alone)"
        )
    if projection_dim is not None and int(projection_dim) < 1:  # type: ignore[call-overload]
        raise ConfigError(f"--projection_dim must be at least 1, got {projection_dim}")
    return vision, text


def check_local_path(name: str, flag: str) -> None:
    """Refuse a name that can only be a local path (``./runs/x``, ``/abs/x``, ``a/b/c``, or ``runs/x`` where
    ``runs`` is a local folder) when nothing is there, instead of asking the hub for it.

    Raises:
        MissingFileError: naming the flag and the path.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(name):
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        local = True
    else:  # "runs/x" has a hub id's form, but is a path when "runs" is a local folder
        local = "/" in name and os.path.isdir(name.split("/")[0])
    if local:
        raise MissingFileError(
            f"{flag} {name}: no such folder ({os.path.abspath(os.path.expanduser(name))} does not exist); pass a "
            "checkpoint folder (vlfit train's --output_dir) or a hub id"
        )


def is_adapter_folder(path: str | None) -> bool:
    """Whether ``path`` is a folder of LoRA adapters (``peft``'s ``save_pretrained``)."""
    return bool(path) and os.path.isfile(os.path.join(str(path), ADAPTER_CONFIG))


def adapter_base(path: str) -> str:
    """The checkpoint a folder of adapters was trained on (``base_model_name_or_path`` of its config), resolved
    against the folder when relative."""
    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path}/{ADAPTER_CONFIG} names no base_model_name_or_path: the adapters have no base model")
    if not os.path.isabs(base):
        # A preset's base is saved in the run folder; a checkpoint-N folder's adapters point to the run's.
        for folder in (path, os.path.dirname(os.path.abspath(path))):
            if os.path.isdir(os.path.join(folder, base)):
                return os.path.join(folder, base)
    return base
