"""Load a checkpoint (local folder or hub id) or build a preset, with its tokenizer and image processor.

Two stages, two names: a ``ModelSpec`` is everything about a model but its weights (family, config, tokenizer,
image processor: all the input pipeline needs, ``InputSpec``), and a ``LoadedModel`` is the model with its spec.
Two steps, so that what needs no weights never builds them: ``resolve_model`` makes the spec, ``build_model`` the
model; ``load_model`` does both. What the model flags name is parsed once, by
``vlfit.models.reference.parse_model_reference``; its family, config, tokenizer and image processor are read by
``vlfit.models.config_and_processors``, and ``resolve_model`` settles the inputs the model is loaded at.

Everything is passed as keyword arguments named as the CLI's flags (``model_name_or_path=``, ``model_preset=``,
``attn_implementation=`` ...): the models layer knows nothing of the CLI's argument dataclasses, which sit above it
and convert themselves (``ModelArguments.source_keywords()`` and ``build_keywords()``).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.config_and_processors import (
    checkpoint_config_and_processors,
    hub_settings,
    preset_config_and_processors,
    two_tower_config_and_processors,
)
from vlfit.models.family import InputSpec, ModelFamily
from vlfit.models.input_spec_file import (
    DEFAULT_MAX_SEQ_LENGTH,
    check_image_settings,
    read_input_settings,
    save_input_settings,
)
from vlfit.models.long_captions import KEPT_POSITIONS, stretch_text_positions, with_text_positions
from vlfit.models.lora import load_merged
from vlfit.models.reference import (
    ModelReference,
    check_local_path,
    parse_model_reference,
    two_towers,
)

logger = logging.getLogger(__name__)

# The keywords of ``resolve_model`` (what model, and the hub settings) and of ``build_model``.
SOURCE_KEYWORDS = ("model_name_or_path", "model_preset", "config_name", "tokenizer_name", "image_processor_name",
                   "cache_dir", "model_revision", "token", "trust_remote_code", "vision_model_name_or_path",
                   "text_model_name_or_path", "projection_dim")  # fmt: skip
BUILD_KEYWORDS = ("attn_implementation", "frozen_towers", "freeze_text_pooler")


@dataclass
class ModelSpec:
    """Everything about a model but its weights (what ``resolve_model`` finds).

    Attributes:
        family: The model family.
        config: The transformers config.
        inputs: Image size, mean, std and tokenizer (what the input pipeline needs).
        image_processor: Saved beside fine-tuned checkpoints.
        checkpoint: The folder or hub id to load weights from; None for a preset (random init) or two towers.
        preset: The preset's name, or None for a checkpoint.
        towers: The pretrained vision and text towers a two-tower model is made of (``--vision_model_name_or_path``,
            ``--text_model_name_or_path``), or None.
        adapters: A folder of LoRA adapters merged into the checkpoint's weights when the model is built.
        hub: The hub settings the checkpoint's weights are loaded with (``cache_dir``, ``revision``, ``token``,
            ``trust_remote_code``).
        checkpoint_text_positions: The text positions the checkpoint (or preset) holds where ``config`` says more:
            ``build_model`` loads them and stretches the tower to the config's (``vlfit.models.long_captions``),
            for captions longer than its own; None: the config's are the checkpoint's.
    """

    family: ModelFamily
    config: Any
    inputs: InputSpec
    image_processor: Any
    checkpoint: str | None = None
    preset: str | None = None
    adapters: str | None = None
    hub: dict[str, Any] = field(default_factory=dict)
    towers: tuple[str, str] | None = None
    checkpoint_text_positions: int | None = None

    @property
    def description(self) -> str:
        """``preset tiny``, the checkpoint, the adapters and their base, or the two towers."""
        if self.towers:
            return f"the towers {self.towers[0]} (vision) and {self.towers[1]} (text)"
        if self.adapters:
            return f"LoRA adapters {self.adapters} on {self.checkpoint}"
        return f"preset {self.preset}" if self.preset else str(self.checkpoint)


@dataclass
class LoadedModel:
    """A model with its spec: its family and everything that defines its inputs (what ``load_model`` returns).

    Attributes:
        model: The model (a transformers ``PreTrainedModel``).
        spec: Its family, config, inputs and image processor, and where its weights came from.
    """

    model: nn.Module
    spec: ModelSpec

    @property
    def family(self) -> ModelFamily:
        return self.spec.family

    @property
    def inputs(self) -> InputSpec:
        return self.spec.inputs

    @property
    def tokenizer(self) -> Any:
        return self.spec.inputs.tokenizer

    @property
    def image_processor(self) -> Any:
        return self.spec.image_processor

    @property
    def image_size(self) -> int:
        return self.spec.inputs.image_size

    def save(self, folder: str) -> None:
        """Save the model, its tokenizer and its image processor into ``folder``: a checkpoint every loader reads."""
        self.model.save_pretrained(folder)
        save_inputs(self.spec, folder)


def saved_tokenizer(spec: ModelSpec) -> Any:
    """A copy of the spec's tokenizer as a saved folder carries it, so that plain transformers tokenizes a
    caption into the inputs vlfit embedded.

    It truncates at the run's ``max_seq_length`` (``model_max_length``; the collator's ``max_length``), and a family
    may set more (``saved_tokenizer_settings``: SigLIP pads to its positions and returns no attention mask). The
    tokenizer vlfit holds is left as it is: its callers always pass ``max_length`` and read the attention mask.
    """
    settings: dict[str, Any] = {"model_max_length": spec.inputs.max_seq_length}
    settings.update(spec.family.saved_tokenizer_settings(spec.config))
    tokenizer = copy.deepcopy(spec.inputs.tokenizer)
    tokenizer.init_kwargs.update(settings)  # save_pretrained writes the init kwargs' keys, with the current values
    for name, value in settings.items():
        setattr(tokenizer, name, value)
    return tokenizer


def save_inputs(spec: ModelSpec, folder: str) -> None:
    """Save the tokenizer (``saved_tokenizer``), image processor (``save_image_processor``) and input settings
    (``input_spec.json``: the caption length and image settings every door reads) of ``spec`` into a model folder."""
    saved_tokenizer(spec).save_pretrained(folder)
    save_image_processor(spec, folder)
    save_input_settings(spec.inputs, folder)


def save_image_processor(spec: ModelSpec, folder: str) -> None:
    """Save the image processor that does what vlfit's input pipeline does to an image
    (``ModelFamily.saved_image_processor``; a checkpoint's own may resize otherwise, e.g. SigLIP's squashes)."""
    spec.family.saved_image_processor(spec.inputs).save_pretrained(folder)


def with_attention_mask(tokenizer: Any) -> Any:
    """``tokenizer``, returning an attention mask by default (vlfit's collator and encoders read one; SigLIP's
    tokenizers, vlfit's saved ones included, return only ``input_ids``)."""
    if "attention_mask" not in tokenizer.model_input_names:
        tokenizer.model_input_names = [*tokenizer.model_input_names, "attention_mask"]
    return tokenizer


def resolve_model(
    *,
    model_name_or_path: str | ModelReference | None = None,
    model_preset: str | None = None,
    config_name: str | None = None,
    tokenizer_name: str | None = None,
    image_processor_name: str | None = None,
    cache_dir: str | None = None,
    model_revision: str = "main",
    token: str | None = None,
    trust_remote_code: bool = False,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int | None = None,
    max_num_patches: int | None = None,
    vision_model_name_or_path: str | None = None,
    text_model_name_or_path: str | None = None,
    projection_dim: int | None = None,
    stretch_text: bool = False,
) -> ModelSpec:
    """The family, config, tokenizer and image processor of ``--model_name_or_path`` or ``--model_preset``.

    Args:
        model_name_or_path: A checkpoint folder, LoRA adapters or a hub id (or its parsed ``ModelReference``);
            exactly one of it and ``model_preset``.
        model_preset: A preset's name or ``.json`` file (random weights).
        config_name: A config to use instead of the checkpoint's or the preset's.
        tokenizer_name: A tokenizer to use instead of the checkpoint's (a preset's is trained on ``captions``).
        image_processor_name: An image processor to use instead of the checkpoint's or the preset's.
        cache_dir: The hub settings (``--cache_dir``, ``--model_revision``, ``--token``, ``--trust_remote_code``);
        model_revision: also used by ``build_model`` to load the weights.
        token: See ``cache_dir``.
        trust_remote_code: See ``cache_dir``.
        captions: Returns the training captions; a preset without ``--tokenizer_name`` trains its tokenizer on them.
        max_seq_length: Longest tokenized caption; None: the length the folder's run was trained at
            (``input_spec.json``), else ``DEFAULT_MAX_SEQ_LENGTH``. One that differs from the run's is logged.
        max_num_patches: A NaFlex model's token budget per image (SigLIP 2); None: the run's record, else its
            image processor's. One that differs from the run's is logged; refused for a model of square images.
        vision_model_name_or_path: With ``text_model_name_or_path`` instead of a checkpoint or preset: a two-tower
            model of these pretrained towers (``vlfit.models.two_tower``), its tokenizer the text tower's and its
            image processor the vision tower's.
        text_model_name_or_path: See ``vision_model_name_or_path``.
        projection_dim: The size of a two-tower model's shared space (default ``DEFAULT_PROJECTION_DIM``).
        stretch_text: A ``max_seq_length`` asked for above the text tower's positions stretches them (training:
            ``vlfit.models.long_captions``) where the family's tower can be; otherwise captions are cut at them.

    Raises:
        ValueError: for neither or both of checkpoint and preset, an unknown preset or model type, a tokenizer
            larger than the model's vocabulary, or an image size that is not a multiple of the patch size.
        MissingFileError: for a local path (not a hub id) that does not exist (``check_local_path``).
    """
    towers = two_towers(model_name_or_path, model_preset, vision_model_name_or_path, text_model_name_or_path,
                        projection_dim)  # fmt: skip
    if towers is None and (model_name_or_path is None) == (model_preset is None):
        raise ConfigError(
            "pass exactly one of --model_name_or_path (a checkpoint folder or hub id) or --model_preset "
            f"(random init); got model_name_or_path={model_name_or_path!r}, model_preset={model_preset!r}"
        )
    hub = hub_settings(cache_dir, model_revision, token, trust_remote_code)
    if towers is not None:
        reference = None
    elif isinstance(model_name_or_path, ModelReference):
        reference = model_name_or_path
    elif model_name_or_path is not None:
        reference = parse_model_reference(model_name_or_path, flag="--model_name_or_path")
    else:
        reference = parse_model_reference(model_preset, flag="--model_preset", kinds=("preset",))  # type: ignore[arg-type]
    named = {"config_name": config_name, "tokenizer_name": tokenizer_name, "image_processor_name": image_processor_name}
    for flag, name in named.items():
        if name is not None:
            check_local_path(name, f"--{flag}")
    checkpoint = reference.weights if reference else None
    preset = reference.path if reference and reference.kind == "preset" else None
    # LoRA adapters: the model is their base's, with them merged in; tokenizer and processor are the run's.
    adapters = reference.path if reference and reference.kind == "adapters" else None
    if towers is not None:
        parts = two_tower_config_and_processors(towers, projection_dim, hub=hub, **named)
    elif preset is None:
        checkpoint = checkpoint or reference.path  # an export folder has no config: loading it says so
        parts = checkpoint_config_and_processors(checkpoint, adapters, hub=hub, **named)
    else:
        parts = preset_config_and_processors(preset, captions, max_seq_length, hub=hub, **named)
    family, config, image_processor = parts.family, parts.config, parts.image_processor
    tokenizer = with_attention_mask(parts.tokenizer)
    record_folder = adapters or (checkpoint if checkpoint and os.path.isdir(checkpoint) else None)
    record = read_input_settings(record_folder) if preset is None else None
    asked, max_seq_length = max_seq_length, _caption_length(max_seq_length, record, record_folder)
    vocab = family.vocab_size(config)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}")
    family.check_tokenizer(config, tokenizer)
    image_size, patch_size = family.input_image_size(config, image_processor), family.patch_size(config)
    if patch_size and image_size % patch_size:
        raise ConfigError(
            f"{checkpoint or preset or towers}: image size {image_size} is not a multiple of the patch size "
            f"{patch_size}; "
            "fix vision_config.image_size or patch_size in its config.json"
        )
    longest = family.max_text_length(config)
    stretched = None
    if longest is not None and max_seq_length > longest and asked is not None and stretch_text:
        if not family.stretches_text_positions:
            raise ConfigError(
                f"--max_seq_length {asked} is longer than the {longest} text positions of {family.name}'s text tower, "
                f"which vlfit cannot stretch (CLIP and SigLIP towers only); give at most {longest}"
            )
        stretched, config = longest, with_text_positions(config, max_seq_length)
        logger.info(
            "--max_seq_length %d is longer than the model's %d text positions: stretching them as Long-CLIP does "
            "(the first %d kept, the rest interpolated)", max_seq_length, longest, KEPT_POSITIONS,
        )  # fmt: skip
    elif longest is not None and max_seq_length > longest:
        # The default (128, run_clip.py's) is longer than CLIP's 77 positions: captions are cut where the model stops,
        # said only to whoever asked for the longer length.
        if asked is not None:
            logger.info("--max_seq_length %d is longer than the model's %d text positions: using %d", max_seq_length,
                        longest, longest)  # fmt: skip
        max_seq_length = longest
    budget = _patch_budget(family, image_processor, max_num_patches, record, record_folder)
    inputs = InputSpec(
        max_num_patches=budget,
        patch_size=patch_size if budget is not None else None,
        image_size=image_size,
        image_mean=tuple(float(x) for x in image_processor.image_mean),  # type: ignore[arg-type]
        image_std=tuple(float(x) for x in image_processor.image_std),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        max_seq_length=max_seq_length,
        matryoshka_dims=tuple(int(size) for size in (record or {}).get("matryoshka_dims", ())),
    )
    if record is not None:
        check_image_settings(record, inputs, record_folder)  # type: ignore[arg-type]
    return ModelSpec(
        family, config, inputs, image_processor, checkpoint=checkpoint, preset=preset, adapters=adapters, hub=hub,
        towers=towers, checkpoint_text_positions=stretched,
    )  # fmt: skip


def _patch_budget(
    family: ModelFamily, image_processor: Any, asked: int | None, record: dict[str, Any] | None, folder: str | None
) -> int | None:
    """A NaFlex model's token budget: ``asked``, else the run's record, else its image processor's (one asked for
    that differs from the run's is said in one line); None for a model of square images.

    Raises:
        ConfigError: for a budget asked of a model of square images, or one below 1.
    """
    own = family.max_num_patches(image_processor)
    if own is None:
        if asked is not None:
            raise ConfigError(
                f"--max_num_patches is for NaFlex models (SigLIP 2); a {family.name} model takes square images of a "
                "fixed size: leave the flag out"
            )
        return None
    if asked is not None and asked < 1:
        raise ConfigError(f"--max_num_patches must be at least 1, got {asked}")
    trained = None if record is None else record.get("max_num_patches")
    if asked is not None and trained is not None and asked != trained:
        logger.warning("images are cut into at most %d patches (--max_num_patches), not the %d %s was trained with",
                    asked, trained, folder)  # fmt: skip
    return int(asked if asked is not None else trained if trained is not None else own)


def _caption_length(asked: int | None, record: dict[str, Any] | None, folder: str | None) -> int:
    """The caption length to load at: ``asked``, else the run's record, else the default; a length asked for that
    differs from the run's is said in one line."""
    if record is None:
        return DEFAULT_MAX_SEQ_LENGTH if asked is None else asked
    trained = int(record["max_seq_length"])
    if asked is not None and asked != trained:
        logger.warning("captions are cut at %d tokens (--max_seq_length), not the %d %s was trained at", asked,
                       trained, folder)  # fmt: skip
    return trained if asked is None else asked


def build_model(
    spec: ModelSpec,
    *,
    attn_implementation: str = "sdpa",
    frozen_towers: Sequence[str] = (),
    freeze_text_pooler: bool = True,
) -> nn.Module:
    """The spec's model: the checkpoint's weights (loaded with the spec's hub settings), or random ones for a
    preset; with the attention kernel and frozen towers given.

    Args:
        spec: What ``resolve_model`` found.
        attn_implementation: ``sdpa`` or ``eager``.
        frozen_towers: The towers not trained: ``vision``, ``text``, ``cross``.
        freeze_text_pooler: Do not train the text pooler.
    """
    family = spec.family
    # The model gets its own copy of the config: setting its attention kernel (and whatever else a model writes
    # into its config) must not change the spec, from which the bench's worker probe and then training each
    # build a model (transformers refuses to build BridgeTower from a config that says sdpa).
    config = copy.deepcopy(spec.config)
    if spec.checkpoint_text_positions is not None:  # loaded as it is, stretched below (Long-CLIP)
        config = with_text_positions(config, spec.checkpoint_text_positions)
    if spec.towers is not None:
        model = family.from_towers(*spec.towers, projection_dim=config.projection_dim, hub=spec.hub)  # type: ignore[attr-defined]
    elif spec.checkpoint is not None:
        model = family.from_pretrained(spec.checkpoint, config=config, **spec.hub)
        if spec.adapters is not None:
            model = load_merged(model, spec.adapters)
    else:
        model = family.build(config)
        if spec.preset is not None:
            family.initialize_preset(model, spec.preset)
    if spec.checkpoint_text_positions is not None:  # captions longer than its positions (Long-CLIP)
        stretch_text_positions(model, family.max_text_length(spec.config))  # type: ignore[arg-type]
    family.set_attention_implementation(model, attn_implementation)
    frozen = tuple(frozen_towers)
    family.freeze(
        model,
        vision="vision" in frozen,
        text="text" in frozen,
        cross="cross" in frozen,
        text_pooler=freeze_text_pooler,
    )
    return model


def load_model(
    *,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int | None = None,
    max_num_patches: int | None = None,
    **keywords: Any,
) -> LoadedModel:
    """``resolve_model`` then ``build_model``: a model with its family, tokenizer and image processor.

    Args:
        captions: Returns the training captions (see ``resolve_model``).
        max_seq_length: Longest tokenized caption (None: the run's, see ``resolve_model``).
        max_num_patches: A NaFlex model's token budget (None: the run's, see ``resolve_model``).
        **keywords: ``resolve_model``'s and ``build_model``'s.

    Raises:
        TypeError: for a keyword neither function takes.
    """
    unknown = sorted(set(keywords) - set(SOURCE_KEYWORDS) - set(BUILD_KEYWORDS))
    if unknown:
        raise TypeError(f"load_model() got unexpected keyword arguments: {', '.join(unknown)}")
    source = {name: value for name, value in keywords.items() if name in SOURCE_KEYWORDS}
    build = {name: value for name, value in keywords.items() if name in BUILD_KEYWORDS}
    spec = resolve_model(captions=captions, max_seq_length=max_seq_length, max_num_patches=max_num_patches, **source)
    return LoadedModel(build_model(spec, **build), spec)
