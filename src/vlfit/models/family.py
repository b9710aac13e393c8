"""The model interface: what training, evaluation and the bench need from a vision-language model family.

A family (BridgeTower, CLIP, SigLIP) is one module that implements ``ModelFamily``
and registers itself in ``vlfit.models.registry``. Nothing in ``vlfit.data``, ``vlfit.training`` or
``vlfit.evaluation`` names a family: they read the image spec and tokenizer from an ``InputSpec``, embed with
``encode_text`` / ``encode_image`` and train with ``contrastive_loss``. A contributor adding a family writes:

- its transformers config class (``config_class``: a preset file's ``config`` is its keyword arguments; the presets
  themselves are JSON files in ``vlfit.models.presets``) and where its vision position embeddings are;
- ``from_pretrained`` and ``build`` (random init) of the model class;
- ``image_size`` (from the config), ``encode_text``, ``encode_image`` (L2-normalized embeddings, the ones the
  contrastive loss compares) and ``contrastive_loss`` with local or global negatives (``vlfit.models.losses``
  has InfoNCE over any set of (query, candidate) embedding pairs, gathered across processes when asked);
- ``freeze`` for the ``--freeze_*`` flags.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.position_embeddings import init_vit_position_embedding
from vlfit.models.presets import Preset, get_preset
from vlfit.models.tokenizer import SPECIAL_TOKENS

# The batch's hard negatives (``--hard_negative_column``): each row's alternative captions, ``[B, K, L]`` token ids
# and attention mask, zero-masked where a row has fewer than K. Inputs of the loss, never of the forward.
HARD_NEGATIVE_INPUT_IDS = "hard_negative_input_ids"
HARD_NEGATIVE_ATTENTION_MASK = "hard_negative_attention_mask"
# Which image each row shows, int64 ``[B]`` (``vlfit.data.records.Record.image_key``): rows with equal keys are
# captions of one image, never each other's negatives in the loss. An input of the loss, never of the forward.
IMAGE_KEYS = "image_keys"

# The image inputs a batch may carry: the pixels, and a NaFlex batch's patch mask and patch grids
# (``vlfit.data.naflex``). ``encode_image`` takes them as keywords.
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")


def image_inputs(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image inputs among a batch's ``inputs``: ``family.encode_image(model, **image_inputs(batch.inputs))``."""
    return {name: inputs[name] for name in IMAGE_INPUTS if name in inputs}


# CLIP's pixel statistics, which CLIP-derived vision towers (BridgeTower's among them) normalize with.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class InputSpec:
    """Everything the input pipeline needs from a model, and nothing that needs the model's weights.

    The single place image size, mean, std and the tokenizer come from: a checkpoint's config and processors,
    or a preset's.

    Attributes:
        image_size: Side of the square images the vision tower takes.
        image_mean: Per-channel normalization mean (0..1 pixel scale).
        image_std: Per-channel normalization std.
        tokenizer: A transformers tokenizer.
        max_seq_length: Captions are truncated to this many tokens.
        max_num_patches: NaFlex (SigLIP 2): each image keeps its aspect ratio as at most this many patches of
            ``patch_size`` (``vlfit.data.naflex``); None: square images of ``image_size``.
        patch_size: The vision tower's patch side (read with ``max_num_patches``).
        matryoshka_dims: The prefix sizes the embedding was trained to be good at besides its full size
            (``vlfit.models.matryoshka``); empty: the full size only.
    """

    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    tokenizer: Any
    max_seq_length: int = 128
    max_num_patches: int | None = None
    patch_size: int | None = None
    matryoshka_dims: tuple[int, ...] = ()

    @property
    def image_input(self) -> str:
        """The images the model takes, as logs and reports name them: ``at most 256 patches of 16 px`` (NaFlex) or
        ``224 px`` (square)."""
        if self.max_num_patches is not None:
            return f"at most {self.max_num_patches} patches of {self.patch_size} px"
        return f"{self.image_size} px"

    def tokenize(self, texts: Sequence[str], *, multiple_of_8: bool = False) -> dict[str, torch.Tensor]:
        """``tokenize_captions`` with this spec's tokenizer and ``max_seq_length``."""
        return tokenize_captions(self.tokenizer, texts, self.max_seq_length, multiple_of_8=multiple_of_8)


def tokenize_captions(
    tokenizer: Any, texts: Sequence[str], max_seq_length: int, *, multiple_of_8: bool = False
) -> dict[str, torch.Tensor]:
    """Token ids and attention mask of ``texts``, ``[len(texts), L]`` int64 each: every caption vlfit embeds or
    trains on is tokenized here (``InputSpec.tokenize`` where the spec is at hand).

    Captions are truncated to ``max_seq_length`` and padded to the longest in the batch, never to
    ``max_seq_length``: shorter sequences are cheaper for every layer. Every family takes this, SigLIP included
    (its own processor pads to ``max_length`` without a mask; its text tower here reads the mask instead, see
    ``vlfit.models.siglip``).

    Args:
        tokenizer: A transformers tokenizer returning an attention mask (``vlfit.models.loading.with_attention_mask``).
        texts: The captions.
        max_seq_length: Truncation length.
        multiple_of_8: Pad to a multiple of 8 tokens when ``max_seq_length`` is one (tensor-core friendly
            shapes for training batches; transformers refuses a truncation length that is not a multiple of it).
    """
    tokens = tokenizer(
        list(texts),
        max_length=max_seq_length,
        truncation=True,
        padding="longest",
        pad_to_multiple_of=8 if multiple_of_8 and max_seq_length % 8 == 0 else None,
        return_tensors="pt",
    )
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


def pipeline_image_processing(inputs: InputSpec) -> dict[str, Any]:
    """What vlfit's input pipeline does to an image, as image-processor settings: RGB, the central square
    resized (bicubic) to ``image_size`` (``resize_crop_uint8``: the short side resized, then the center cropped),
    scaled to 0..1 and normalized with the spec's mean and std. Every family's saved processor is built from these.
    """
    side = inputs.image_size
    return {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": side},
        "resample": 3,  # PIL's BICUBIC
        "do_center_crop": True,
        "crop_size": {"height": side, "width": side},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(inputs.image_mean),
        "image_std": list(inputs.image_std),
    }


@dataclass(frozen=True)
class LossScope:
    """What a contrastive loss compares, as the run's flags say.

    Attributes:
        global_negatives: Score against every process's batch (all-gathered with gradient), so the negatives are
            the whole global batch; with one process this equals the local loss (``--contrastive_negatives global``).
        symmetric: Add the image->text term to the model's own terms where they lack it
            (``--contrastive_loss symmetric``).
    """

    global_negatives: bool = False
    symmetric: bool = False

    @classmethod
    def of(cls, args: Any) -> LossScope:
        """The scope a run's training arguments ask for."""
        return cls(
            global_negatives=getattr(args, "contrastive_negatives", "local") == "global",
            symmetric=getattr(args, "contrastive_loss", "model") == "symmetric",
        )


LOCAL_LOSS = LossScope()
"""This process's batch, the family's own terms."""


@dataclass
class LossEmbeddings:
    """What a family's loss is computed from, and all it needs from the model's forward.

    Split from the loss so that gradient caching (``vlfit.training.gradient_cache``) can compute it chunk by chunk
    without activations, take the loss's gradient with respect to it over the whole batch, and back-propagate
    that through each chunk again.

    Attributes:
        rows: Per-pair tensors, ``[n, ...]`` with row ``i`` belonging to pair ``i`` (embeddings; hard negatives'
            ``[n, k, d]`` embeddings and their ``[n, k]`` bool validity).
        shared: Tensors the whole batch shares (the logit scale, a bias), the same in every chunk.
    """

    rows: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]


class ModelFamily(ABC):
    """One model family: presets, loading, unimodal embeddings and the contrastive loss.

    Attributes:
        name: Shown in logs and reports, and what a preset file's ``family`` says.
        model_types: The transformers ``config.model_type`` values a checkpoint of this family has.
        config_class: The transformers config class; a preset file's ``config`` holds its keyword arguments.
        model_inputs: The keys of a batch's model inputs the forward takes.
        preset_special_tokens: Special tokens of a preset's trained tokenizer, in id order.
        vision_class_token: The vision position embeddings' first row is the class token's (left at zero by a
            preset's ``sincos`` init).
        stretches_text_positions: The text tower holds one learned position table that training can stretch for
            longer captions (``vlfit.models.long_captions``).
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    config_class: ClassVar[Any]
    vision_class_token: ClassVar[bool] = True
    stretches_text_positions: ClassVar[bool] = False
    model_inputs: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask", "pixel_values")
    # The special tokens of the tokenizer trained for a preset, in id order (vlfit.models.tokenizer).
    preset_special_tokens: ClassVar[tuple[str, ...]] = SPECIAL_TOKENS

    # ----------------------------------------------------------------------------------------- presets, loading

    def saved_tokenizer_settings(self, config: Any) -> dict[str, Any]:
        """Tokenizer settings a saved folder carries beyond vlfit's own (``vlfit.models.loading.saved_tokenizer``),
        so that plain transformers tokenizes as vlfit does (SigLIP: pad to the positions, no attention mask)."""
        return {}

    def preset(self, preset: str) -> Preset:
        """The preset ``preset`` (a name or a preset file's path), which must be of this family."""
        found = get_preset(preset)
        if found.family != self.name:
            raise ConfigError(f"preset {preset} ({found.path}) is a {found.family} preset, not a {self.name} one")
        return found

    def preset_config(self, preset: str) -> Any:
        """The transformers config of ``preset``: ``config_class`` called with its file's ``config`` (as a
        ``config.json`` does, settings the class does not name are kept as attributes: BridgeTower's
        ``contrastive_hidden_size`` and ``logit_scale_init_value`` are read so)."""
        return self.config_class(**copy.deepcopy(self.preset(preset).config))

    def preset_tokenizer_vocab_size(self, preset: str) -> int:
        """Vocabulary size of the tokenizer trained for ``preset`` when none is given (default: its text tower's)."""
        size = self.preset(preset).tokenizer_vocab_size
        return size if size is not None else int(self.vocab_size(self.preset_config(preset)))  # type: ignore[arg-type]

    def preset_image_processor(self, preset: str) -> Any:
        """The image processor (mean, std) of ``preset``: its file's ``image_processor``."""
        import transformers
        from transformers.image_processing_utils import BaseImageProcessor

        found = self.preset(preset)
        settings = copy.deepcopy(found.image_processor)
        kind = settings.pop("image_processor_type")
        image_processor_class = getattr(transformers, kind, None)
        if not (isinstance(image_processor_class, type) and issubclass(image_processor_class, BaseImageProcessor)):
            raise ConfigError(
                f"preset {preset} ({found.path}): image_processor_type {kind!r} is not a transformers image "
                "processor class (e.g. CLIPImageProcessor)"
            )
        return image_processor_class(**settings)

    def saved_image_processor(self, inputs: InputSpec) -> Any:
        """The image processor a saved model folder carries: one that does what vlfit's input pipeline does
        (``pipeline_image_processing``), so that ``AutoProcessor`` in plain transformers feeds the model the pixels
        vlfit trained and evaluated it on, whatever the image's shape.

        Default: a ``CLIPImageProcessor``, whose resize and crop are exactly these. A family overrides it to keep
        its own class where that class can be set to do the same.
        """
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor(**pipeline_image_processing(inputs))

    def max_num_patches(self, image_processor: Any) -> int | None:
        """The token budget of a NaFlex model's images (its processor's ``max_num_patches``); None for a model of
        square images."""
        return None

    @abstractmethod
    def build(self, config: Any) -> nn.Module:
        """The model with random weights."""

    def initialize_preset(self, model: nn.Module, preset: str) -> None:
        """Initialize a freshly built ``preset`` where it starts otherwise than ``build``: the vision position
        embeddings as its ``vision_position_init`` says."""
        if self.preset(preset).vision_position_init == "sincos":
            init_vit_position_embedding(self.vision_position_embedding(model), class_token=self.vision_class_token)

    def vision_position_embedding(self, model: nn.Module) -> torch.Tensor:
        """The weight of the vision tower's position embeddings, ``[positions, width]``."""
        raise NotImplementedError(f"{self.name} does not say where its vision position embeddings are")

    @abstractmethod
    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> nn.Module:
        """Load a checkpoint (``hub_kwargs``: cache_dir, revision, token, trust_remote_code, config)."""

    @abstractmethod
    def image_size(self, config: Any) -> int:
        """Input image side of a model with ``config``."""

    def input_image_size(self, config: Any, image_processor: Any) -> int:
        """The side of the images the input pipeline feeds a model with ``config`` and ``image_processor``: the
        config's ``image_size`` (a family whose towers take what their processor says overrides it)."""
        return self.image_size(config)

    def patch_size(self, config: Any) -> int | None:
        """Side of the vision tower's patches (the image size must be a multiple of it), or None when unknown."""
        size = getattr(getattr(config, "vision_config", None), "patch_size", None)
        return int(size) if size is not None else None

    def max_text_length(self, config: Any) -> int | None:
        """Longest caption in tokens the text tower embeds (its position embeddings), or None when unknown."""
        text_config = getattr(config, "text_config", config)
        positions = getattr(text_config, "max_position_embeddings", None)
        return int(positions) if positions is not None else None

    def vocab_size(self, config: Any) -> int | None:
        """Token embeddings of the text tower (a tokenizer must not exceed it), or None when unknown."""
        text_config = getattr(config, "text_config", config)
        return getattr(text_config, "vocab_size", None)

    def check_tokenizer(self, config: Any, tokenizer: Any) -> None:  # noqa: B027
        """Refuse a tokenizer the model cannot read as it was trained to (a ``ConfigError``); any by default."""

    def export_context(self) -> contextlib.AbstractContextManager:
        """Where ``vlfit export`` traces the towers (a family whose transformers code asserts on tensor values, which
        ONNX cannot express, lifts those checks there; the checks' inputs come from vlfit's own pipeline)."""
        return contextlib.nullcontext()

    def set_attention_implementation(self, model: nn.Module, implementation: str) -> None:
        """Choose the attention kernel (``--attn_implementation``: eager, sdpa, ...); transformers' own by default."""
        model.set_attn_implementation(implementation)  # type: ignore[operator]

    def module_groups(self) -> dict[str, tuple[str, ...]]:
        """The model's towers by name (``text``, ``vision``, ``cross``): the prefixes of their modules' names, as
        ``--lora_target`` selects them."""
        return {}

    def head_modules(self) -> tuple[str, ...]:
        """The projections into the shared embedding space (trained in full beside LoRA adapters)."""
        return ()

    def untrained_modules(self) -> tuple[str, ...]:
        """Modules the contrastive loss never reaches (no adapters go there)."""
        return ()

    def freeze(self, model: nn.Module, *, vision: bool, text: bool, text_pooler: bool, cross: bool = False) -> None:
        """Disable gradients of the named towers (``module_groups``) and, with ``text_pooler``, of the modules the
        loss never reaches (``untrained_modules``; freezing keeps saved checkpoints complete, and DDP fails on
        parameters without gradients).

        Raises:
            ValueError: for a tower the model does not have, naming those it has.
        """
        groups = self.module_groups()
        for name, wanted in (("vision", vision), ("text", text), ("cross", cross)):
            if not wanted:
                continue
            if name not in groups:
                raise ConfigError(
                    f"--freeze {name}: a {self.name} model has no {name} tower; it has: {', '.join(groups) or 'none'}"
                )
            for prefix in groups[name]:
                model.get_submodule(prefix).requires_grad_(False)
        if text_pooler:
            for name in self.untrained_modules():
                model.get_submodule(name).requires_grad_(False)

    # -------------------------------------------------------------------------------- embeddings and the loss

    @abstractmethod
    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """L2-normalized caption embeddings ``[B, D]`` (the ones the contrastive loss compares).

        Differentiable (few-shot fine-tuning trains through ``encode_image``): callers that only embed wrap the
        call in ``torch.no_grad()`` or ``torch.inference_mode()``.
        """

    @abstractmethod
    def encode_image(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """L2-normalized image embeddings ``[B, D]`` from normalized pixels (differentiable, as ``encode_text``)."""

    def prepare_for_training(self, model: nn.Module) -> None:  # noqa: B027
        """Called once on the unwrapped model before training (e.g. to install forward hooks)."""

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        """The forward of one batch (or chunk of it) as the loss needs it, with gradient (``model`` as training
        calls it: possibly wrapped by DDP). Families without it cannot use gradient caching."""
        raise NotImplementedError(f"{self.name} does not split its loss from its forward (gradient caching)")

    def loss_from_embeddings(self, embeddings: LossEmbeddings, scope: LossScope = LOCAL_LOSS) -> torch.Tensor:
        """The loss of ``loss_embeddings``' output, as ``contrastive_loss`` computes it."""
        raise NotImplementedError(f"{self.name} does not split its loss from its forward (gradient caching)")

    @abstractmethod
    def contrastive_loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:
        """The training loss of one batch.

        Args:
            model: The model as training calls it (possibly wrapped by DDP or FSDP: call it, do not reach inside).
            inputs: ``model_inputs`` on the model's device.
            scope: Which negatives and terms (``LossScope``).

        When ``inputs`` hold ``HARD_NEGATIVE_INPUT_IDS`` / ``HARD_NEGATIVE_ATTENTION_MASK``, the image->text
        term also scores each image against its own hard negatives (``vlfit.models.losses.HardNegatives``).

        Returns:
            A scalar; with global negatives, this process's share such that averaging over processes (as DDP
            does with gradients) gives the loss of the concatenated batch.
        """
