"""Load a checkpoint (local folder or hub id) or build a preset, with its tokenizer and image processor.

Two steps, so that what needs no weights never builds them: ``resolve_model`` finds the family, the config, the
tokenizer (trained on the captions for a preset) and the image processor, which is all the input pipeline needs
(``InputSpec``); ``load_model_bundle`` adds the model itself.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from vlfit.errors import ConfigError, MissingFileError, ModelLoadError, first_line
from vlfit.models.family import InputSpec, ModelFamily
from vlfit.models.lora import adapter_base, is_adapter_folder, load_merged
from vlfit.models.registry import family_for_config, family_for_preset
from vlfit.models.tokenizer import train_caption_tokenizer

if TYPE_CHECKING:
    from vlfit.arguments import ModelArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelBlueprint:
    """Everything about a model but its weights.

    Attributes:
        family: The model family.
        config: The transformers config.
        inputs: Image size, mean, std and tokenizer (what the input pipeline needs).
        image_processor: Saved beside fine-tuned checkpoints.
        checkpoint: The folder or hub id to load weights from; None for a preset (random init).
        preset: The preset's name, or None for a checkpoint.
        adapters: A folder of LoRA adapters merged into the checkpoint's weights when the model is built.
    """

    family: ModelFamily
    config: Any
    inputs: InputSpec
    image_processor: Any
    checkpoint: str | None = None
    preset: str | None = None
    adapters: str | None = None

    @property
    def description(self) -> str:
        """``preset tiny``, the checkpoint, or the adapters and their base."""
        if self.adapters:
            return f"LoRA adapters {self.adapters} on {self.checkpoint}"
        return f"preset {self.preset}" if self.preset else str(self.checkpoint)


@dataclass
class ModelBundle:
    """A model with its family and everything that defines its inputs."""

    model: nn.Module
    blueprint: ModelBlueprint

    @property
    def family(self) -> ModelFamily:
        return self.blueprint.family

    @property
    def inputs(self) -> InputSpec:
        return self.blueprint.inputs

    @property
    def tokenizer(self) -> Any:
        return self.blueprint.inputs.tokenizer

    @property
    def image_processor(self) -> Any:
        return self.blueprint.image_processor

    @property
    def image_size(self) -> int:
        return self.blueprint.inputs.image_size

    def save(self, folder: str) -> None:
        """Save the model, its tokenizer and its image processor into ``folder``: a checkpoint every loader reads."""
        self.model.save_pretrained(folder)
        save_inputs(self.blueprint, folder)


def saved_tokenizer(blueprint: ModelBlueprint) -> Any:
    """A copy of the blueprint's tokenizer as a saved folder carries it, so that plain transformers tokenizes a
    caption into the inputs vlfit embedded.

    It truncates at the run's ``max_seq_length`` (``model_max_length``; the collator's ``max_length``), and a family
    may set more (``saved_tokenizer_settings``: SigLIP pads to its positions and returns no attention mask). The
    tokenizer vlfit holds is left as it is: its callers always pass ``max_length`` and read the attention mask.
    """
    settings: dict[str, Any] = {"model_max_length": blueprint.inputs.max_seq_length}
    settings.update(blueprint.family.saved_tokenizer_settings(blueprint.config))
    tokenizer = copy.deepcopy(blueprint.inputs.tokenizer)
    tokenizer.init_kwargs.update(settings)  # save_pretrained writes the init kwargs' keys, with the current values
    for name, value in settings.items():
        setattr(tokenizer, name, value)
    return tokenizer


def save_inputs(blueprint: ModelBlueprint, folder: str) -> None:
    """Save the tokenizer (``saved_tokenizer``) and image processor (``save_image_processor``) of ``blueprint``
    into a model folder."""
    saved_tokenizer(blueprint).save_pretrained(folder)
    save_image_processor(blueprint, folder)


def save_image_processor(blueprint: ModelBlueprint, folder: str) -> None:
    """Save the image processor that does what vlfit's input pipeline does to an image
    (``ModelFamily.saved_image_processor``; a checkpoint's own may resize otherwise, e.g. SigLIP's squashes)."""
    blueprint.family.saved_image_processor(blueprint.inputs).save_pretrained(folder)


def with_attention_mask(tokenizer: Any) -> Any:
    """``tokenizer``, returning an attention mask by default (vlfit's collator and encoders read one; SigLIP's
    tokenizers, vlfit's saved ones included, return only ``input_ids``)."""
    if "attention_mask" not in tokenizer.model_input_names:
        tokenizer.model_input_names = [*tokenizer.model_input_names, "attention_mask"]
    return tokenizer


def check_local_path(name: str, flag: str) -> None:
    """Refuse a model name that can only be a local path (``./runs/x``, ``/abs/x``, ``a/b/c``, or ``runs/x`` where
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


def _hub_kwargs(args: ModelArguments) -> dict[str, Any]:
    kwargs = {"cache_dir": args.cache_dir, "revision": args.model_revision, "token": args.token}
    if getattr(args, "trust_remote_code", False):
        kwargs["trust_remote_code"] = True
    return kwargs


def _load_processor(auto_class: Any, what: str, flag: str, name_or_path: str, hub: dict[str, Any]) -> Any:
    """``auto_class.from_pretrained``, failing with one line that names what is missing where and ``flag``."""
    try:
        return auto_class.from_pretrained(name_or_path, **hub)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{name_or_path}: cannot load its {what} ({first_line(error, 200)}); save the {what} beside "
            f"the model (vlfit train does) or pass {flag}"
        ) from error


def resolve_model(
    args: ModelArguments,
    *,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int = 128,
) -> ModelBlueprint:
    """The family, config, tokenizer and image processor of ``--model_name_or_path`` or ``--model_preset``.

    Args:
        args: ``--model_name_or_path`` or ``--model_preset`` (exactly one), ``--config_name``,
            ``--tokenizer_name``, ``--image_processor_name``, ``--trust_remote_code`` and the hub settings
            (``--use_fast_tokenizer`` changes nothing: transformers 5 always loads the fast tokenizer).
        captions: Returns the training captions; a preset without ``--tokenizer_name`` trains its tokenizer on them.
        max_seq_length: Longest tokenized caption.

    Raises:
        ValueError: for neither or both of checkpoint and preset, an unknown preset or model type, a tokenizer
            larger than the model's vocabulary, or an image size that is not a multiple of the patch size.
        MissingFileError: for a local path (not a hub id) that does not exist (``check_local_path``).
    """
    checkpoint, preset = args.model_name_or_path, args.model_preset
    if (checkpoint is None) == (preset is None):
        raise ConfigError(
            "pass exactly one of --model_name_or_path (a checkpoint folder or hub id) or --model_preset "
            f"(random init); got model_name_or_path={checkpoint!r}, model_preset={preset!r}"
        )
    hub = _hub_kwargs(args)
    config_name = getattr(args, "config_name", None)
    named = {"--model_name_or_path": checkpoint, "--config_name": config_name, "--tokenizer_name": args.tokenizer_name,
             "--image_processor_name": args.image_processor_name}  # fmt: skip
    for flag, name in named.items():
        if name is not None:
            check_local_path(name, flag)
    adapters = checkpoint if is_adapter_folder(checkpoint) else None
    if adapters is not None:
        # LoRA adapters: the model is their base's, with them merged in; tokenizer and processor are the run's.
        checkpoint = adapter_base(adapters)
    if checkpoint is not None:
        try:
            config = AutoConfig.from_pretrained(config_name or checkpoint, **hub)
        except OSError as error:  # not a folder with a config.json, and not a hub id that can be reached
            raise ModelLoadError(
                f"{config_name or checkpoint}: cannot load a model config ({first_line(error, 200)}); "
                "pass a folder with config.json (what vlfit train writes), a hub id, or --model_preset"
            ) from error
        family = family_for_config(config)
        tokenizer = _load_processor(
            AutoTokenizer, "tokenizer", "--tokenizer_name", args.tokenizer_name or adapters or checkpoint, hub
        )
        image_processor = _load_processor(
            AutoImageProcessor,
            "image processor",
            "--image_processor_name",
            args.image_processor_name or adapters or checkpoint,
            hub,
        )
    else:
        family = family_for_preset(preset)  # type: ignore[arg-type]
        config = AutoConfig.from_pretrained(config_name, **hub) if config_name else family.preset_config(preset)
        if args.tokenizer_name is not None:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name, **hub)
        else:
            if captions is None:
                raise ConfigError(f"preset {preset!r} needs training captions or --tokenizer_name")
            logger.info("training a byte-level BPE tokenizer on the training captions (no --tokenizer_name given)")
            tokenizer = train_caption_tokenizer(
                captions(),
                vocab_size=family.preset_tokenizer_vocab_size(preset),
                model_max_length=max_seq_length,
                special_tokens=family.preset_special_tokens,
            )
        image_processor = (
            AutoImageProcessor.from_pretrained(args.image_processor_name, **hub)
            if args.image_processor_name
            else family.preset_image_processor(preset)
        )
    tokenizer = with_attention_mask(tokenizer)
    vocab = family.vocab_size(config)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}")
    image_size, patch_size = family.image_size(config), family.patch_size(config)
    if patch_size and image_size % patch_size:
        raise ConfigError(
            f"{checkpoint or preset}: image size {image_size} is not a multiple of the patch size {patch_size}; "
            "fix vision_config.image_size or patch_size in its config.json"
        )
    longest = family.max_text_length(config)
    if longest is not None and max_seq_length > longest:
        # run_clip.py's default (128) is longer than CLIP's 77 positions: captions are cut where the model stops.
        logger.info("--max_seq_length %d is longer than the model's %d text positions: using %d", max_seq_length,
                    longest, longest)  # fmt: skip
        max_seq_length = longest
    inputs = InputSpec(
        image_size=image_size,
        image_mean=tuple(float(x) for x in image_processor.image_mean),  # type: ignore[arg-type]
        image_std=tuple(float(x) for x in image_processor.image_std),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        max_seq_length=max_seq_length,
    )
    return ModelBlueprint(
        family, config, inputs, image_processor, checkpoint=checkpoint, preset=preset, adapters=adapters
    )


def build_model(blueprint: ModelBlueprint, args: ModelArguments) -> nn.Module:
    """The blueprint's model: the checkpoint's weights, or random ones for a preset; with the attention kernel and
    frozen towers the flags say."""
    family = blueprint.family
    # The model gets its own copy of the config: setting its attention kernel (and whatever else a model writes
    # into its config) must not change the blueprint, from which the bench's worker probe and then training each
    # build a model (transformers refuses to build BridgeTower from a config that says sdpa).
    config = copy.deepcopy(blueprint.config)
    if blueprint.checkpoint is not None:
        model = family.from_pretrained(blueprint.checkpoint, config=config, **_hub_kwargs(args))
        if blueprint.adapters is not None:
            model = load_merged(model, blueprint.adapters)
    else:
        model = family.build(config)
        if blueprint.preset is not None:
            family.initialize_preset(model, blueprint.preset)
    family.set_attention_implementation(model, getattr(args, "attn_implementation", "sdpa"))
    frozen = args.frozen_towers() if hasattr(args, "frozen_towers") else ()
    family.freeze(
        model,
        vision="vision" in frozen,
        text="text" in frozen,
        cross="cross" in frozen,
        text_pooler=getattr(args, "freeze_text_pooler", True),
    )
    return model


def load_model_bundle(
    args: ModelArguments,
    *,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int = 128,
) -> ModelBundle:
    """``resolve_model`` then ``build_model``: a model with its family, tokenizer and image processor."""
    blueprint = resolve_model(args, captions=captions, max_seq_length=max_seq_length)
    return ModelBundle(build_model(blueprint, args), blueprint)
