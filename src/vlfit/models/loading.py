"""Load a checkpoint (local folder or hub id) or build a preset, with its tokenizer and image processor.

Two steps, so that what needs no weights never builds them: ``resolve_model`` finds the family, the config, the
tokenizer (trained on the captions for a preset) and the image processor, which is all the input pipeline needs
(``InputSpec``); ``load_model_bundle`` adds the model itself.

Everything is passed as keyword arguments named as the CLI's flags (``model_name_or_path=``, ``model_preset=``,
``attn_implementation=`` ...): the models layer knows nothing of the CLI's argument dataclasses, which sit above it.
An object holding those names as attributes may still be passed first instead; it is read by name.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from vlfit.errors import ConfigError, MissingFileError, ModelLoadError, first_line
from vlfit.models.family import InputSpec, ModelFamily
from vlfit.models.lora import adapter_base, is_adapter_folder, load_merged
from vlfit.models.registry import family_for_config, family_for_preset
from vlfit.models.tokenizer import train_caption_tokenizer

logger = logging.getLogger(__name__)

# The keywords of ``resolve_model`` (what model, and the hub settings) and of ``build_model``, with their defaults.
SOURCE_KEYWORDS: dict[str, Any] = {
    "model_name_or_path": None,
    "model_preset": None,
    "config_name": None,
    "tokenizer_name": None,
    "image_processor_name": None,
    "cache_dir": None,
    "model_revision": "main",
    "token": None,
    "trust_remote_code": False,
}
BUILD_KEYWORDS: dict[str, Any] = {"attn_implementation": "sdpa", "frozen_towers": (), "freeze_text_pooler": True}
_HUB_KEYWORDS = ("cache_dir", "model_revision", "token", "trust_remote_code")


def _keywords(options: object | None, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given``, or with ``options`` the same names read from its attributes (a method is called: the CLI's
    ``frozen_towers()``); an attribute it lacks keeps its default.

    Raises:
        TypeError: for ``options`` together with a keyword set away from its default.
    """
    if options is None:
        return given
    both = sorted(name for name, value in given.items() if value != defaults[name])
    if both:
        raise TypeError(f"pass the model options as an object or as keywords, not both (got {', '.join(both)})")
    values = {}
    for name, default in defaults.items():
        value = getattr(options, name, default)
        values[name] = value() if callable(value) else value
    return values


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
        hub: The hub settings the checkpoint's weights are loaded with (``cache_dir``, ``revision``, ``token``,
            ``trust_remote_code``).
    """

    family: ModelFamily
    config: Any
    inputs: InputSpec
    image_processor: Any
    checkpoint: str | None = None
    preset: str | None = None
    adapters: str | None = None
    hub: dict[str, Any] = field(default_factory=dict)

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


def _hub_kwargs(
    cache_dir: str | None, model_revision: str, token: str | None, trust_remote_code: bool
) -> dict[str, Any]:
    kwargs = {"cache_dir": cache_dir, "revision": model_revision, "token": token}
    if trust_remote_code:
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
    options: object | None = None,
    /,
    *,
    model_name_or_path: str | None = None,
    model_preset: str | None = None,
    config_name: str | None = None,
    tokenizer_name: str | None = None,
    image_processor_name: str | None = None,
    cache_dir: str | None = None,
    model_revision: str = "main",
    token: str | None = None,
    trust_remote_code: bool = False,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int = 128,
) -> ModelBlueprint:
    """The family, config, tokenizer and image processor of ``--model_name_or_path`` or ``--model_preset``.

    Args:
        options: Instead of the keywords below, an object holding them as attributes (read by name).
        model_name_or_path: A checkpoint folder, LoRA adapters or a hub id; exactly one of it and ``model_preset``.
        model_preset: A preset's name (random weights).
        config_name: A config to use instead of the checkpoint's or the preset's.
        tokenizer_name: A tokenizer to use instead of the checkpoint's (a preset's is trained on ``captions``).
        image_processor_name: An image processor to use instead of the checkpoint's or the preset's.
        cache_dir: The hub settings (``--cache_dir``, ``--model_revision``, ``--token``, ``--trust_remote_code``);
        model_revision: also used by ``build_model`` to load the weights.
        token: See ``cache_dir``.
        trust_remote_code: See ``cache_dir``.
        captions: Returns the training captions; a preset without ``--tokenizer_name`` trains its tokenizer on them.
        max_seq_length: Longest tokenized caption.

    Raises:
        ValueError: for neither or both of checkpoint and preset, an unknown preset or model type, a tokenizer
            larger than the model's vocabulary, or an image size that is not a multiple of the patch size.
        MissingFileError: for a local path (not a hub id) that does not exist (``check_local_path``).
    """
    given = dict(
        model_name_or_path=model_name_or_path, model_preset=model_preset, config_name=config_name,
        tokenizer_name=tokenizer_name, image_processor_name=image_processor_name, cache_dir=cache_dir,
        model_revision=model_revision, token=token, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    keywords = _keywords(options, SOURCE_KEYWORDS, given)
    checkpoint, preset = keywords["model_name_or_path"], keywords["model_preset"]
    config_name, tokenizer_name = keywords["config_name"], keywords["tokenizer_name"]
    image_processor_name = keywords["image_processor_name"]
    if (checkpoint is None) == (preset is None):
        raise ConfigError(
            "pass exactly one of --model_name_or_path (a checkpoint folder or hub id) or --model_preset "
            f"(random init); got model_name_or_path={checkpoint!r}, model_preset={preset!r}"
        )
    hub = _hub_kwargs(*(keywords[name] for name in _HUB_KEYWORDS))
    named = {"--model_name_or_path": checkpoint, "--config_name": config_name, "--tokenizer_name": tokenizer_name,
             "--image_processor_name": image_processor_name}  # fmt: skip
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
            AutoTokenizer, "tokenizer", "--tokenizer_name", tokenizer_name or adapters or checkpoint, hub
        )
        image_processor = _load_processor(
            AutoImageProcessor,
            "image processor",
            "--image_processor_name",
            image_processor_name or adapters or checkpoint,
            hub,
        )
    else:
        family = family_for_preset(preset)  # type: ignore[arg-type]
        config = AutoConfig.from_pretrained(config_name, **hub) if config_name else family.preset_config(preset)
        if tokenizer_name is not None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, **hub)
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
            AutoImageProcessor.from_pretrained(image_processor_name, **hub)
            if image_processor_name
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
        family, config, inputs, image_processor, checkpoint=checkpoint, preset=preset, adapters=adapters, hub=hub
    )


def build_model(
    blueprint: ModelBlueprint,
    options: object | None = None,
    /,
    *,
    attn_implementation: str = "sdpa",
    frozen_towers: Sequence[str] = (),
    freeze_text_pooler: bool = True,
) -> nn.Module:
    """The blueprint's model: the checkpoint's weights (loaded with the blueprint's hub settings), or random ones for
    a preset; with the attention kernel and frozen towers given.

    Args:
        blueprint: What ``resolve_model`` found.
        options: Instead of the keywords below, an object holding them as attributes (read by name; its hub
            settings, when it has them, load the weights).
        attn_implementation: ``sdpa`` or ``eager``.
        frozen_towers: The towers not trained: ``vision``, ``text``, ``cross``.
        freeze_text_pooler: Do not train the text pooler.
    """
    given = dict(
        attn_implementation=attn_implementation, frozen_towers=frozen_towers, freeze_text_pooler=freeze_text_pooler
    )
    keywords = _keywords(options, BUILD_KEYWORDS, given)
    hub = blueprint.hub
    if options is not None and hasattr(options, "cache_dir"):
        hub = _hub_kwargs(*(_keywords(options, SOURCE_KEYWORDS, {})[name] for name in _HUB_KEYWORDS))
    family = blueprint.family
    # The model gets its own copy of the config: setting its attention kernel (and whatever else a model writes
    # into its config) must not change the blueprint, from which the bench's worker probe and then training each
    # build a model (transformers refuses to build BridgeTower from a config that says sdpa).
    config = copy.deepcopy(blueprint.config)
    if blueprint.checkpoint is not None:
        model = family.from_pretrained(blueprint.checkpoint, config=config, **hub)
        if blueprint.adapters is not None:
            model = load_merged(model, blueprint.adapters)
    else:
        model = family.build(config)
        if blueprint.preset is not None:
            family.initialize_preset(model, blueprint.preset)
    family.set_attention_implementation(model, keywords["attn_implementation"])
    frozen = tuple(keywords["frozen_towers"])
    family.freeze(
        model,
        vision="vision" in frozen,
        text="text" in frozen,
        cross="cross" in frozen,
        text_pooler=keywords["freeze_text_pooler"],
    )
    return model


def load_model_bundle(
    options: object | None = None,
    /,
    *,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int = 128,
    **keywords: Any,
) -> ModelBundle:
    """``resolve_model`` then ``build_model``: a model with its family, tokenizer and image processor.

    Args:
        options: Instead of keywords, an object holding them as attributes (read by name).
        captions: Returns the training captions (see ``resolve_model``).
        max_seq_length: Longest tokenized caption.
        **keywords: ``resolve_model``'s and ``build_model``'s.

    Raises:
        TypeError: for a keyword neither function takes.
    """
    unknown = sorted(set(keywords) - set(SOURCE_KEYWORDS) - set(BUILD_KEYWORDS))
    if unknown:
        raise TypeError(f"load_model_bundle() got unexpected keyword arguments: {', '.join(unknown)}")
    source = {name: value for name, value in keywords.items() if name in SOURCE_KEYWORDS}
    build = {name: value for name, value in keywords.items() if name in BUILD_KEYWORDS}
    blueprint = resolve_model(options, captions=captions, max_seq_length=max_seq_length, **source)
    return ModelBundle(build_model(blueprint, options, **build), blueprint)
