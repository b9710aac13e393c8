"""Whether train mode fits in memory: checked before the model is built and the sweep starts.

The estimate is arithmetic, not a trial step:

- parameters are counted on a model built on the ``meta`` device (the family's own ``build``, so the count is
  exact for any preset or checkpoint config, and nothing is allocated), frozen ones apart;
- state per parameter: fp32 weights (4 bytes), and for trainable ones a gradient (4) and AdamW's two moments (8);
- activations kept for the backward pass, from the config's transformer shapes: per layer and token about
  ``(34 + 5 * heads * keys / hidden) * hidden`` bytes with 16-bit activations (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022: eager attention, dropout masks included), twice
  that in fp32; tokens are the caption length for the text tower, the patches (plus the class token) for the
  vision tower, and both for a cross-modal tower, which an image-text matching objective (``--objective
  contrastive+itm`` or ``itm``) runs on three pairs per sample: the pair, a negative image and a negative caption.

The figure is meant as a floor, not a forecast: under bf16/fp16 autocast some saved tensors stay fp32 (softmax
outputs, layer-norm inputs, the residual stream), which the 16-bit count leaves out, and allocator slack comes on
top. On CPU it came within about 20% below the measured peak of the small and base presets in fp32 (and further
below under bf16 autocast). A run whose floor does not fit in the memory it would use, free CUDA memory
(``torch.cuda.mem_get_info``) on a GPU or the host memory available to this process on the CPU (the cgroup limit
a container sets, else psutil's ``available``), cannot fit; one whose floor fits may still
not, and then its configurations end as failed rows with the out-of-memory error.

Why not probe one training step in a child process, which would be exact: it builds the model a second time (tens
of seconds for the large preset, out of a sweep's time budget), and a step that does not fit on the host takes
the machine into swap or the OOM killer, which is what the check is there to avoid. What the estimate misses is
still caught during the sweep: a configuration that runs out of memory becomes a failed row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from vlfit.errors import ConfigError
from vlfit.models.family import ModelFamily
from vlfit.training.itm_objective import CONTRASTIVE, uses_itm

GIB = 2**30
# Bytes of state per parameter: fp32 weights; gradient and AdamW's exp_avg and exp_avg_sq for trainable ones.
WEIGHT_BYTES = 4
TRAINABLE_STATE_BYTES = 4 + 8
# Bytes per saved activation value: fp32, or 16-bit under autocast (the floor: see the module docstring).
ACTIVATION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
# Pairs per sample the cross-modal tower runs under an image-text matching objective (vlfit.models.itm_loss): the
# pair itself, one negative image per caption and one negative caption per image.
ITM_FUSED_PAIRS = 3
CROSS_MODAL = "cross-modal"


class DoesNotFit(ConfigError):
    """Train mode would run out of memory with this model, batch and precision (raised before the sweep)."""


@dataclass(frozen=True)
class Tower:
    """One transformer stack of the model, as the activation estimate sees it."""

    name: str
    layers: int
    hidden: int
    heads: int
    tokens: int
    keys: int  # tokens each query attends to (more than ``tokens`` in a cross-attending layer)

    def activation_bytes(self, batch_size: int, value_bytes: int = 2) -> float:
        """Activation bytes this stack keeps for the backward pass, with values of ``value_bytes`` bytes."""
        per_token = self.hidden * (34 + 5 * self.heads * self.keys / self.hidden)  # bytes at 2 bytes a value
        return self.layers * batch_size * self.tokens * per_token * value_bytes / 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step needs at least at its peak, by kind."""

    parameters: int
    trainable_parameters: int
    weights: int
    gradients_and_optimizer: int
    activations: int
    towers: tuple[Tower, ...]

    @property
    def total(self) -> int:
        return self.weights + self.gradients_and_optimizer + self.activations

    def describe(self) -> str:
        """``21.3 GiB = weights 3.2 + gradients and AdamW 9.7 + activations 8.4 GiB (866.6M parameters, ...)``."""
        return (
            f"{self.total / GIB:.1f} GiB = weights {self.weights / GIB:.1f} + gradients and AdamW "
            f"{self.gradients_and_optimizer / GIB:.1f} + activations {self.activations / GIB:.1f} GiB "
            f"({self.parameters / 1e6:.1f}M parameters, {self.trainable_parameters / 1e6:.1f}M trained)"
        )


def count_parameters(family: ModelFamily, config: Any, freeze: dict[str, bool]) -> tuple[int, int]:
    """``(all, trainable)`` parameters of the family's model for ``config``, counted on the meta device.

    Args:
        family: The model family.
        config: Its transformers config.
        freeze: ``vision``, ``text`` and ``text_pooler``: the ``--freeze_*`` flags.
    """
    with torch.device("meta"):
        model = family.build(config)
    family.freeze(model, **freeze)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def _shape(config: Any) -> tuple[int, int, int] | None:
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not layers or not hidden:
        return None
    return layers, hidden, getattr(config, "num_attention_heads", None) or max(1, hidden // 64)


def towers(config: Any, *, image_size: int, max_seq_length: int) -> list[Tower]:
    """The transformer stacks of a vision-language config: text, vision and (when it has one) cross-modal."""
    found: list[Tower] = []
    text_tokens = max_seq_length
    image_tokens = 0
    text_config, vision_config = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if text_config is not None and (shape := _shape(text_config)):
        found.append(Tower("text", *shape, tokens=text_tokens, keys=text_tokens))
    if vision_config is not None and (shape := _shape(vision_config)):
        patch = getattr(vision_config, "patch_size", None) or 16
        image_tokens = (image_size // patch) ** 2 + 1
        found.append(Tower("vision", *shape, tokens=image_tokens, keys=image_tokens))
    if (text_config is not None or vision_config is not None) and (shape := _shape(config)):
        # A fused tower (BridgeTower's cross-modal layers): each stream attends to itself and to the other.
        tokens = text_tokens + image_tokens
        found.append(Tower(CROSS_MODAL, *shape, tokens=tokens, keys=tokens))
    if not found and (shape := _shape(config)):
        found.append(Tower("model", *shape, tokens=text_tokens, keys=text_tokens))
    return found


def estimate_training_memory(
    family: ModelFamily,
    config: Any,
    *,
    image_size: int,
    max_seq_length: int,
    batch_size: int,
    precision: str,
    objective: str = CONTRASTIVE,
    freeze: dict[str, bool] | None = None,
) -> MemoryEstimate:
    """What one training step of the model needs at least at its peak (see the module docstring).

    Args:
        family: The model family.
        config: Its transformers config.
        image_size: Input image side.
        max_seq_length: Caption length in tokens (the longest a batch can have).
        batch_size: Samples per step.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        objective: ``vlfit train --objective``: with image-text matching the cross-modal tower's activations are
            those of ``ITM_FUSED_PAIRS`` pairs per sample.
        freeze: ``vision``, ``text`` and ``text_pooler`` (the ``--freeze_*`` flags); default: nothing but the text
            pooler, as ``vlfit train`` does.
    """
    freeze = freeze if freeze is not None else {"vision": False, "text": False, "text_pooler": True}
    total, trainable = count_parameters(family, config, freeze)
    stacks = tuple(towers(config, image_size=image_size, max_seq_length=max_seq_length))
    fused_pairs = ITM_FUSED_PAIRS if uses_itm(objective) else 1
    activations = sum(
        tower.activation_bytes(
            batch_size * (fused_pairs if tower.name == CROSS_MODAL else 1), ACTIVATION_BYTES[precision]
        )
        for tower in stacks
    )
    return MemoryEstimate(
        parameters=total,
        trainable_parameters=trainable,
        weights=WEIGHT_BYTES * total,
        gradients_and_optimizer=TRAINABLE_STATE_BYTES * trainable,
        activations=int(activations),
        towers=stacks,
    )


# ---------------------------------------------------------------------------------------------------- memory


def _cgroup_available() -> int | None:
    """Memory a cgroup v2 (or v1) limit leaves this container, or None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        with contextlib.suppress(OSError, ValueError):
            with open(limit_file) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 2**60:  # no limit (v1 writes a huge number)
                return None
            with open(usage_file) as f:
                return max(0, int(text) - int(f.read().strip()))
    return None


def _host_available() -> int:
    return int(psutil.virtual_memory().available)


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes a training step on ``device`` may use, and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory on {torch.cuda.get_device_name(device)}"
    host, cgroup = _host_available(), _cgroup_available()
    if cgroup is not None and cgroup < host:
        return cgroup, "host memory left under this container's limit"
    return host, "available host memory"


def check_fit(
    estimate: MemoryEstimate,
    available: int,
    where: str,
    *,
    model: str,
    batch_size: int,
    precision: str,
) -> None:
    """Raise ``DoesNotFit`` when the estimate exceeds the available memory.

    Args:
        estimate: From ``estimate_training_memory``.
        available: Bytes available.
        where: What ``available`` measures (for the message).
        model: The model as the message names it (``preset large``).
        batch_size: The batch size (for the message).
        precision: The precision (for the message).
    """
    if estimate.total <= available:
        return
    state = estimate.weights + estimate.gradients_and_optimizer
    # Activations grow with the batch, the rest does not: the largest batch whose floor would fit.
    fitting_batch = int(batch_size * (available - state) / estimate.activations) if estimate.activations else 0
    hints = []
    if fitting_batch >= 1:
        hints.append(f"--per_device_train_batch_size {min(fitting_batch, batch_size - 1)} or less")
    hints.append("a smaller --model_preset (or --freeze_vision_model / --freeze_text_model)")
    if precision == "fp32":
        hints.append("--bf16 (activations take less room)")
    hints.append("--mode loader to measure the data path alone (it builds no model)")
    raise DoesNotFit(
        f"train mode with {model} at batch {batch_size} ({precision}) does not fit: it needs at least "
        f"{estimate.describe()}, and {where} is {available / GIB:.1f} GiB. Try {'; or '.join(hints)}. "
        "(The figure is an estimate from the parameter count and the model's shapes; --skip_fit_check runs anyway.)"
    )


def memory_settings(estimate: MemoryEstimate, available: int, where: str) -> dict[str, Any]:
    """The estimate as JSON-able fields for the results' settings."""
    return {
        "estimated_train_memory_gib": round(estimate.total / GIB, 2),
        "available_memory_gib": round(available / GIB, 2),
        "available_memory_from": where,
    }
