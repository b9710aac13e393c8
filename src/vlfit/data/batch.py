"""``Batch``: what the input pipeline hands the trainer, the evaluator and the bench.

One typed object instead of a dict with side-channel keys. The collator makes it in a loader worker (uint8 or
float pixels, or encoded images for device decode); the device stage turns it into model inputs on the device
(``on_device``). Per-sample fields are lists or tensors in the same row order; ``select`` keeps rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vlfit.data.image_transforms import EncodedImage

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
