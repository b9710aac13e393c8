"""The order a training epoch reads its records in: ``--caption_sampling`` and ``--train_sampling_strategy``.

- ``--caption_sampling one_per_image``: each image once per epoch with one caption drawn
  (``vlfit.data.caption_sampling``).
- ``--train_sampling_strategy group_by_length``: a NaFlex model's images in batches of similar patch counts
  (``vlfit.data.patch_count_grouping``), so little of a batch is padding.
- Otherwise the Trainer's own order: ``random`` (the default) or ``sequential``.

Evaluation always reads its split in order (``VlfitTrainer._get_eval_sampler``). The rules tying these flags to
others are in ``vlfit.arguments.flag_rules``; the one tying ``group_by_length`` to the model is here, since it needs
the resolved model.
"""

from __future__ import annotations

import logging

from torch.utils.data import Sampler

from vlfit.arguments import DataArguments
from vlfit.data.caption_sampling import OneCaptionPerImageSampler
from vlfit.data.image_groups import image_groups
from vlfit.data.patch_count_grouping import PatchCountGroupedSampler, patch_counts
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import ConfigError
from vlfit.models.family import InputSpec
from vlfit.training.arguments import VlfitTrainingArguments

logger = logging.getLogger(__name__)

GROUP_BY_LENGTH = "group_by_length"


def check_train_sampling(inputs: InputSpec, training_args: VlfitTrainingArguments) -> None:
    """Refuse ``--train_sampling_strategy group_by_length`` for a model whose images all have one length.

    Raises:
        ConfigError: one line, naming the flag.
    """
    if training_args.train_sampling_strategy == GROUP_BY_LENGTH and inputs.max_num_patches is None:
        raise ConfigError(
            f"--train_sampling_strategy {GROUP_BY_LENGTH} groups a NaFlex model's (SigLIP 2's) images by their patch "
            f"count; this model takes every image at {inputs.image_size} x {inputs.image_size} px, so its batches "
            "have one length already: drop the flag"
        )


def training_sampler(
    source: ImageTextSource | None,
    inputs: InputSpec,
    data_args: DataArguments,
    training_args: VlfitTrainingArguments,
) -> Sampler[int] | None:
    """The training order the flags ask for; ``None``: the Trainer's (``random`` or ``sequential``), or no training
    split."""
    if source is None:
        return None
    if data_args.caption_sampling == "one_per_image":  # flag_rules refuses it beside a --train_sampling_strategy
        how = "their image ids" if data_args.image_id_column else "reading their image bytes"
        logger.info("grouping %d training captions by image (%s)", len(source), how)
        groups = image_groups(source.image_keys())
        logger.info("--caption_sampling one_per_image: an epoch is %d images (of %d captions)", len(groups),
                    len(source))  # fmt: skip
        return OneCaptionPerImageSampler(groups, training_args.seed)
    if training_args.train_sampling_strategy == GROUP_BY_LENGTH:
        check_train_sampling(inputs, training_args)
        assert inputs.max_num_patches is not None and inputs.patch_size is not None
        logger.info("--train_sampling_strategy %s: counting the patches of %d training images (their headers)",
                    GROUP_BY_LENGTH, len(source))  # fmt: skip
        lengths = patch_counts(source, int(inputs.patch_size), int(inputs.max_num_patches))
        return PatchCountGroupedSampler(lengths, training_args.train_batch_size, training_args.seed)
    return None
