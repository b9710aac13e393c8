"""``Batch``: what the input pipeline hands the trainer, the evaluator and the bench.

One typed object instead of a dict with side-channel keys. The collator makes it in a loader worker (uint8 or
float pixels, or encoded images for device decode); the device stage turns it into model inputs on the device
(``on_device``). Per-sample fields are lists or tensors in the same row order; ``select`` keeps rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from vlfit.data.image_transforms import EncodedImage
from vlfit.data.worker_memory import BY_VALUE_BYTES

# Where a bad sample was found: in a worker (replaced by a substitute in training, left out in evaluation), or at
# device decode (dropped from its batch, which shrinks by one).
WORKER, DEVICE = "worker", "device"


@dataclass(frozen=True)
class BadSample:
    """A sample the pipeline could not use.

    Attributes:
        id: The sample's id (or ``row N`` when the record could not even be read).
        reason: What is wrong with it.
        stage: ``worker`` or ``device`` (see above).
    """

    id: str
    reason: str
    stage: str = WORKER


@dataclass
class Batch:
    """One batch of image-text pairs.

    Attributes:
        inputs: The model inputs: ``input_ids``, ``attention_mask`` and ``pixel_values`` (uint8 ``[B, 3, H, W]``
            before the device stage on the fast pipeline, normalized floats after it). Absent ``pixel_values``
            while ``encoded_images`` waits for device decode.
        sample_ids: Each row's sample id.
        positions: Each row's index in its dataset (evaluation merges processes' results by it).
        bad_samples: Samples found bad while this batch was made (not rows of it).
        encoded_images: Encoded bytes per row for ``--decode_on_device``, until the device stage decodes them.
        columns: Extra per-row columns the evaluation reads (``caption_choices``, ``label``).
        on_device: The device stage has run: ``inputs`` are ready for the model.
        stream_positions: From a stream: the positions of the items the batch was made from (its rows and the bad
            samples it skipped), for ``ShardStream.mark_consumed`` once the batch is used.
    """

    inputs: dict[str, torch.Tensor]
    sample_ids: list[str]
    positions: list[int]
    bad_samples: list[BadSample] = field(default_factory=list)
    encoded_images: list[EncodedImage] | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    on_device: bool = False
    stream_positions: list[Any] = field(default_factory=list)

    @classmethod
    def empty(cls, bad_samples: Sequence[BadSample] = (), stream_positions: Sequence[Any] = ()) -> Batch:
        """A batch without rows (every sample of it was bad and left out)."""
        return cls(inputs={}, sample_ids=[], positions=[], bad_samples=list(bad_samples),
                   stream_positions=list(stream_positions))  # fmt: skip

    def __len__(self) -> int:
        return len(self.sample_ids)

    # The Trainer reads model inputs by key (token counts, FLOP estimates) and tests ``"labels" in batch``.
    def __getitem__(self, key: str) -> torch.Tensor:
        return self.inputs[key]

    def __contains__(self, key: object) -> bool:
        return key in self.inputs

    def keys(self) -> Iterator[str]:
        return iter(self.inputs)

    # A batch reaches the main process from a loader worker pickled by multiprocessing, where torch sends each
    # tensor's storage as a shared-memory file descriptor that the main process then fetches from the worker: one
    # round trip per tensor, answered by a thread of the worker that waits for the worker's GIL while it decodes.
    # Tensors up to BY_VALUE_BYTES (the text's always, a small batch's pixels) go by value inside the pickle
    # instead; larger ones keep the shared memory, one round trip each. Training the tiny preset at batch 16 on 2
    # cores, this took its data wait from 7.0% of the run to 2.6%.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["inputs"] = {key: _ByValue.of(value) or value for key, value in self.inputs.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        inputs = state["inputs"]
        state["inputs"] = {key: v.tensor() if isinstance(v, _ByValue) else v for key, v in inputs.items()}
        self.__dict__.update(state)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on ``device`` (encoded images stay on the host, where decoders read them)."""
        moved = {key: value.to(device, non_blocking=non_blocking) for key, value in self.inputs.items()}
        return replace(self, inputs=moved)

    def pin_memory(self) -> Batch:
        """The batch with its tensors in pinned host memory (the DataLoader calls this with ``pin_memory``)."""
        return replace(self, inputs={key: value.pin_memory() for key, value in self.inputs.items()})

    def select(self, rows: Sequence[int]) -> Batch:
        """The batch holding only ``rows`` (in that order); ``bad_samples`` is kept as it is."""
        index = None
        inputs = {}
        for key, value in self.inputs.items():
            if index is None or index.device != value.device:
                index = torch.tensor(list(rows), dtype=torch.long, device=value.device)
            inputs[key] = value.index_select(0, index)
        return replace(
            self,
            inputs=inputs,
            sample_ids=[self.sample_ids[i] for i in rows],
            positions=[self.positions[i] for i in rows],
            encoded_images=None if self.encoded_images is None else [self.encoded_images[i] for i in rows],
            columns={name: [values[i] for i in rows] for name, values in self.columns.items()},
        )


@dataclass(frozen=True)
class _ByValue:
    """A small host tensor as a NumPy array, which pickles by value, in its memory order: ``channels_last`` says
    the array is the ``[B, H, W, C]`` buffer of a channels-last ``[B, C, H, W]`` tensor (the image batches' layout)."""

    array: np.ndarray
    channels_last: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _ByValue | None:
        """``tensor`` by value, or ``None`` where it is large, on a device, needs gradients, is not dense in either
        layout or has a dtype NumPy lacks (bfloat16)."""
        if tensor.device.type != "cpu" or tensor.requires_grad or tensor.nbytes > BY_VALUE_BYTES:
            return None
        channels_last = not tensor.is_contiguous()
        if channels_last:
            if tensor.dim() != 4 or not tensor.is_contiguous(memory_format=torch.channels_last):
                return None
            tensor = tensor.permute(0, 2, 3, 1)
        try:
            return cls(tensor.numpy(), channels_last)
        except TypeError:
            return None

    def tensor(self) -> torch.Tensor:
        tensor = torch.from_numpy(self.array)
        return tensor.permute(0, 3, 1, 2) if self.channels_last else tensor
