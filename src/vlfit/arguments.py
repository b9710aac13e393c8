"""Command-line arguments: the names run_bridgetower.py uses, plus vlfit's input-pipeline flags.

Parsed with ``vlfit.commands.parsing.CommandParser`` (``HfArgumentParser``) together with
``vlfit.training.arguments.VlfitTrainingArguments`` (every ``TrainingArguments`` flag) or, for ``vlfit eval``,
``EvalArguments``, so one JSON or YAML file can hold them all. Nothing here imports torch or transformers: a
command's ``--help`` answers without loading them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vlfit.compat_flags import CompatDataFlags
from vlfit.data.bad_samples import BAD_SAMPLE_POLICIES, MIN_SAMPLES_FOR_BAD_FRACTION, check_bad_sample_policy
from vlfit.data.file_patterns import is_stream_spec
from vlfit.data.source_base import DEFAULT_COLUMNS
from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.models.presets import list_presets

if TYPE_CHECKING:
    from vlfit.data.stream.shards import ShardReader
    from vlfit.models.lora import LoraSettings

# The CPU-stage pipelines (--image_pipeline): vlfit.data.image_transforms implements each.
IMAGE_PIPELINES = ("fast", "reference")
# How a training epoch walks several captions per image (vlfit.data.caption_sampling).
CAPTION_SAMPLING = ("every", "one_per_image")

# The data-location flags that say how shard URLs are read rather than where the data is.
SHARD_ACCESS = ("storage_options", "shard_block_size")

# What --freeze names (each family's module_groups says which it has).
TOWERS = ("text", "vision", "cross")


@dataclass
class ModelArguments:
    """Which model to fine-tune, and what to freeze."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint of a supported model family (BridgeTower, CLIP, SigLIP), or a folder of LoRA "
            "adapters a vlfit run saved: a local folder or a hub id."
        },
    )
    model_preset: str | None = field(
        default=None,
        metadata={
            "help": f"Build a model with random weights instead: one of {', '.join(list_presets())}, or the path "
            "of a preset .json file (written as the shipped ones in vlfit/models/presets/ are). "
            "A byte-level BPE tokenizer is trained on the training captions unless --tokenizer_name is given."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer to use instead of the model's."})
    image_processor_name: str | None = field(
        default=None, metadata={"help": "Image processor (mean, std) to use instead of the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models and datasets are cached."})
    model_revision: str = field(default="main", metadata={"help": "Model branch, tag or commit."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models or datasets."})
    freeze_vision_model: bool = field(default=False, metadata={"help": "Do not train the vision encoder."})
    freeze_text_model: bool = field(default=False, metadata={"help": "Do not train the text encoder."})
    freeze: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated towers not to train: text, vision, cross (BridgeTower's cross-modal layers). "
            "--freeze vision is open_clip's locked-image tuning; --freeze_vision_model / --freeze_text_model "
            "(run_clip.py's and run_bridgetower.py's) add to it."
        },
    )
    unfreeze_after_steps: int | None = field(
        default=None,
        metadata={
            "help": "Train the towers --freeze (or --freeze_*_model) froze after this many optimizer steps (they "
            "are in the optimizer from the start, without gradients until then). One process only."
        },
    )
    freeze_text_pooler: bool = field(
        default=True, metadata={"help": "Do not train the text pooler (the contrastive loss never reaches it)."}
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "Attention kernel: sdpa (PyTorch's fused scaled_dot_product_attention) or eager (matmul, "
            "softmax, matmul). For BridgeTower, whose transformers class runs its text and cross-modal attention "
            "eagerly only, vlfit supplies the sdpa path (equal to eager within float tolerance)."
        },
    )
    logit_scale_init_value: float | None = field(
        default=None,
        metadata={
            "help": "Start training with the model's logit scale (the log of the inverse temperature: its exp "
            "multiplies the similarities of the contrastive loss) at this value, instead of the checkpoint's or "
            "the config's (BridgeTower, CLIP: ln(1/0.07) = 2.659). For models with a logit_scale parameter."
        },
    )
    lora_r: int | None = field(
        default=None,
        metadata={
            "help": "Fine-tune LoRA adapters of this rank (through peft) instead of every weight: the adapters and "
            "the projection heads train, the rest stays; the run saves the adapters only (vlfit merge-lora makes "
            "a plain checkpoint of them)."
        },
    )
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling numerator (default 2 * r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA adapters' input."})
    lora_target: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated: towers (text, vision, cross: BridgeTower's cross-modal layers) or linear module "
            "names (query, v_proj, ...). Default: every tower."
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Pretrained config name or path, if not the same as --model_name_or_path."}
    )
    use_fast_tokenizer: bool = field(
        default=True,
        metadata={
            "help": "Use a fast tokenizer (backed by the tokenizers library). transformers 5 always does, so "
            "--no_use_fast_tokenizer changes nothing."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Trust the execution of code from models defined on the Hub. Only set this for repositories "
            "you trust and whose code you have read: it runs that code on your machine."
        },
    )

    def __post_init__(self) -> None:
        if self.model_preset is not None:
            from vlfit.models.registry import family_for_preset

            family_for_preset(self.model_preset)  # an unknown name fails here, before any data is opened
        unknown = sorted(set(self.frozen_towers()) - set(TOWERS))
        if unknown:
            raise ConfigError(f"--freeze {','.join(unknown)}: unknown tower; choose from {', '.join(TOWERS)}")
        if self.unfreeze_after_steps is not None:
            if not self.frozen_towers():
                raise ConfigError("--unfreeze_after_steps needs a frozen tower (--freeze text|vision|cross)")
            if int(self.unfreeze_after_steps) < 1:
                raise ConfigError(f"--unfreeze_after_steps must be at least 1, got {self.unfreeze_after_steps}")
            if self.lora_r is not None:
                raise ConfigError("--unfreeze_after_steps with --lora_r: LoRA trains its adapters only; drop one")
        if self.lora_r is not None:
            require_extra("lora", "--lora_r (LoRA adapters)")
        if self.lora_r is not None and int(self.lora_r) < 1:
            raise ConfigError(f"--lora_r must be at least 1, got {self.lora_r}")
        if self.lora_r is None and (self.lora_target or self.lora_alpha is not None):
            raise ConfigError("--lora_target and --lora_alpha need --lora_r (the adapters' rank)")

    def frozen_towers(self) -> tuple[str, ...]:
        """The towers ``--freeze`` and ``--freeze_vision_model`` / ``--freeze_text_model`` name."""
        towers = [t.strip() for t in (self.freeze or "").split(",") if t.strip()]
        towers += [name for name, on in (("vision", self.freeze_vision_model), ("text", self.freeze_text_model)) if on]
        return tuple(dict.fromkeys(towers))

    def lora_settings(self) -> LoraSettings | None:
        """The LoRA flags, or None without ``--lora_r``."""
        if self.lora_r is None:
            return None
        from vlfit.models.lora import LoraSettings

        targets = tuple(t.strip() for t in (self.lora_target or "").split(",") if t.strip())
        return LoraSettings(int(self.lora_r), self.lora_alpha, float(self.lora_dropout), targets)


@dataclass
class DataLocationArguments:
    """Where the image-text pairs come from and which columns hold them (shared by train, eval and prepare)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A hub dataset id (e.g. jmhessel/newyorker_caption_contest), a folder written by save_to_disk "
            "(e.g. by `vlfit make-data`), a folder of parquet, jsonl, json, csv or tar files (split by name, e.g. by "
            "`vlfit prepare`), or such files themselves (a path, glob or {a..b} pattern: split train)."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config (e.g. matching)."})
    dataset_revision: str | None = field(default=None, metadata={"help": "Hub dataset branch, tag or commit."})
    data_dir: str | None = field(default=None, metadata={"help": "data_dir passed to datasets.load_dataset."})
    train_file: str | None = field(
        default=None,
        metadata={"help": "Training data: parquet, jsonl/json or csv (image paths relative to it), or .tar shards."},
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "Validation data, same formats; shard URLs (https://, s3://...) are read from local copies."},
    )
    test_file: str | None = field(default=None, metadata={"help": "Test data, same formats."})
    image_column: str = field(
        default=DEFAULT_COLUMNS["image"][0],
        metadata={
            "help": "Column holding images (bytes, paths or PIL). Not given: the first of "
            f"{', '.join(DEFAULT_COLUMNS['image'])} that the data has."
        },
    )
    caption_column: str = field(
        default=DEFAULT_COLUMNS["caption"][0],
        metadata={
            "help": "Column holding the captions. Not given: the first of "
            f"{', '.join(DEFAULT_COLUMNS['caption'])} that the data has."
        },
    )
    id_column: str | None = field(
        default=None, metadata={"help": "Column with sample ids (default: instance_id or id if present, else row)."}
    )
    image_id_column: str | None = field(
        default=None,
        metadata={
            "help": "Column naming the image a row shows (e.g. COCO's image_id): rows with equal values are captions "
            "of one image, for evaluation (recall over unique images) and the loss (never each other's negatives). "
            "Default: rows with identical image bytes are one image. A caption column holding lists of captions is "
            "read as one row per caption."
        },
    )

    storage_options: str | None = field(
        default=None,
        metadata={
            "help": "Shard URLs: fsspec storage options, a JSON object (headers, auth, client_kwargs, block_size...), "
            'e.g. \'{"headers": {"Authorization": "Bearer ..."}}\'; every command that reads shard URLs uses them.'
        },
    )
    shard_block_size: int | None = field(
        default=None,
        metadata={
            "help": "Shard URLs: bytes fetched per HTTP Range request (fsspec's block_size). 0: each shard is one "
            "whole-file GET, for servers that ignore Range requests (otherwise detected on the first such answer)."
        },
    )

    def __post_init__(self) -> None:
        self.fsspec_options()
        if self.shard_block_size is not None and int(self.shard_block_size) < 0:
            raise ConfigError(
                f"--shard_block_size must be 0 (whole-file streams) or more bytes, not {self.shard_block_size}"
            )

    def fsspec_options(self) -> dict[str, Any]:
        """``--storage_options`` as a dict (``{}`` when not given).

        Raises:
            ConfigError: naming the flag, when it is not a JSON object.
        """
        raw = self.storage_options
        if raw is None or raw == "":
            return {}
        if isinstance(raw, dict):
            return dict(raw)
        try:
            options = json.loads(raw)
        except ValueError as err:
            raise ConfigError(
                f"--storage_options is not valid JSON ({err}); give an object, e.g. '{{\"headers\": {{}}}}'"
            ) from None
        if not isinstance(options, dict):
            raise ConfigError(
                f"--storage_options must be a JSON object of fsspec options, not {type(options).__name__}"
            )
        return options

    def shard_reader(self) -> ShardReader:
        """How shard URLs are read: ``--storage_options``, ``--shard_block_size`` and, where the command has them,
        ``--shard_retries`` and ``--shard_timeout``."""
        from vlfit.data.stream.shards import ShardReader

        retries, timeout = getattr(self, "shard_retries", None), getattr(self, "shard_timeout", None)
        return ShardReader(
            retries=3 if retries is None else int(retries),
            timeout=60.0 if timeout is None else float(timeout),
            storage_options=self.fsspec_options(),
            block_size=None if self.shard_block_size is None else int(self.shard_block_size),
        )

    def source_kwargs(self) -> dict[str, Any]:
        """The data-location and column flags as keyword arguments of ``vlfit.data.sources.open_splits`` (the
        shard-access flags as its ``shard_reader``)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(DataLocationArguments) if f.name not in SHARD_ACCESS}
        return {**kwargs, "shard_reader": self.shard_reader()}


@dataclass
class StreamArguments:
    """How a streamed training split is read (``vlfit.data.stream``): tar shards at fsspec URLs, mixed, shuffled."""

    streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream the training split shard by shard instead of opening it as a map-style dataset: "
            "--train_file tar shards (local, or implied by URLs and '::' sources), or --dataset_name's data files "
            "(a hub id or a local folder of parquet or tar shards). Needs --max_steps: a stream has no length."
        },
    )
    train_data_weights: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated weights of the '::'-separated sources of --train_file (open_clip's upsampling "
            "factors): samples are drawn from each source in proportion. Default: all 1."
        },
    )
    shuffle_buffer: int = field(
        default=1000,
        metadata={
            "help": "Samples each loader worker's shuffle buffer holds when streaming (0: shard order, no shuffle); "
            "shard order is shuffled per epoch too. Deterministic per --seed."
        },
    )
    resampled: bool = field(
        default=False,
        metadata={
            "help": "Streaming: draw shards with replacement, endlessly (open_clip's --dataset-resampled), instead "
            "of reading each shard once per epoch."
        },
    )
    shard_retries: int = field(
        default=3,
        metadata={
            "help": "Streaming: times a failing shard (HTTP error, dropped connection, timeout) is tried again, with "
            "backoff, before it is given up and counted as a bad sample under --max_bad_fraction."
        },
    )
    shard_timeout: float = field(
        default=60.0, metadata={"help": "Streaming: seconds a connection or one read may take before it is a fault."}
    )

    def streams_training(self) -> bool:
        """Whether the training split is streamed: ``--streaming``, or a ``--train_file`` that only streams."""
        return bool(self.streaming or is_stream_spec(getattr(self, "train_file", None)))

    def check_stream_flags(self) -> None:
        """Refuse stream flags without a stream, and bad values.

        Raises:
            ConfigError: naming the flag.
        """
        if self.train_data_weights is not None and not self.streams_training():
            raise ConfigError("--train_data_weights weights the '::' sources of a streamed --train_file; add them")
        if int(self.shuffle_buffer) < 0:
            raise ConfigError(f"--shuffle_buffer must be 0 (no shuffle) or more samples, not {self.shuffle_buffer}")
        if int(self.shard_retries) < 0:
            raise ConfigError(f"--shard_retries must be 0 or more, not {self.shard_retries}")
        if not float(self.shard_timeout) > 0:
            raise ConfigError(f"--shard_timeout must be a positive number of seconds, not {self.shard_timeout}")


@dataclass
class DataArguments(CompatDataFlags, StreamArguments, DataLocationArguments):
    """Data location plus how samples are turned into model inputs."""

    max_seq_length: int = field(default=128, metadata={"help": "Captions are truncated to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training samples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation samples."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Accepted for run_bridgetower.py compatibility; vlfit preprocesses lazily."}
    )
    image_pipeline: str = field(
        default="fast",
        metadata={
            "help": "fast: DCT-scaled decode and uint8 resize in workers, normalize on the device. "
            "reference: run_bridgetower.py's Pillow/float pipeline, all on the CPU.",
            "choices": list(IMAGE_PIPELINES),
        },
    )
    decode_on_device: bool = field(
        default=False,
        metadata={"help": "Workers only read bytes; JPEGs are decoded on the GPU with nvJPEG (CPU fallback)."},
    )
    random_resized_crop: bool = field(default=False, metadata={"help": "Random resized crop (fast pipeline)."})
    horizontal_flip: bool = field(default=False, metadata={"help": "Random horizontal flip, on the device."})
    hard_negative_column: str | None = field(
        default=None,
        metadata={
            "help": "A column of alternative captions per sample (a list of strings, e.g. caption_choices of the "
            "New Yorker matching config or of `vlfit make-data` data): training also scores each image against "
            "its own alternatives, beside the batch's captions (NegCLIP's hard negatives). The sample's own choice "
            "is left out: the one its label column points to, or else any equal to its caption."
        },
    )
    caption_sampling: str = field(
        default="every",
        metadata={
            "help": "How a training epoch walks several captions per image: every (each caption once per epoch) or "
            "one_per_image (each image once per epoch, with one of its captions drawn anew each epoch).",
            "choices": list(CAPTION_SAMPLING),
        },
    )
    eval_split: str = field(default="validation", metadata={"help": "Split that --do_eval evaluates."})
    eval_pool_size: int | None = field(
        default=None, metadata={"help": "Recall@k over pools of this many images (default: the whole split)."}
    )
    zeroshot_dataset: list[str] | None = field(
        default=None,
        metadata={
            "help": "Labelled data to classify zero-shot at every evaluation (any data source form; several may be "
            "given): top-1/top-5 accuracy logged beside the retrieval metrics as eval_zeroshot_top1 (with several, "
            "eval_zeroshot_<name>_top1), to watch what fine-tuning forgets."
        },
    )
    zeroshot_label_column: str = field(
        default="label", metadata={"help": "The class column of --zeroshot_dataset (a ClassLabel or text)."}
    )
    zeroshot_split: str = field(default="test", metadata={"help": "The split of --zeroshot_dataset to classify."})
    prompt_template: list[str] | None = field(
        default=None,
        metadata={
            "help": "Zero-shot prompts, '{}' the class name; several are averaged (default: vlfit fewshot's five, "
            "'a photo of a {}.', ...)."
        },
    )
    bad_sample_policy: str = field(
        default="skip",
        metadata={
            "help": "What to do with a sample whose image cannot be read or decoded or whose caption is missing, "
            "empty or whitespace. skip: training replaces it by another sample (batches keep their size), "
            "evaluation leaves it out; each is logged and listed in bad_samples.jsonl. raise: stop with an error "
            "naming the sample.",
            "choices": list(BAD_SAMPLE_POLICIES),
        },
    )
    max_bad_fraction: float = field(
        default=0.01,
        metadata={
            "help": "With --bad_sample_policy skip, stop training once more than this fraction of the samples read "
            f"so far were bad (judged after max({MIN_SAMPLES_FOR_BAD_FRACTION}, 1/fraction) samples, or once a "
            "smaller split was read whole). "
            "0: the first bad sample stops the run; 1: never stop."
        },
    )

    def __post_init__(self) -> None:
        DataLocationArguments.__post_init__(self)
        if self.image_pipeline not in IMAGE_PIPELINES:
            raise ConfigError(
                f"unknown --image_pipeline {self.image_pipeline!r}; choose one of: {', '.join(IMAGE_PIPELINES)}"
            )
        if self.caption_sampling not in CAPTION_SAMPLING:
            raise ConfigError(
                f"unknown --caption_sampling {self.caption_sampling!r}; choose one of: {', '.join(CAPTION_SAMPLING)}"
            )
        check_bad_sample_policy(self.bad_sample_policy)
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"--max_bad_fraction must be between 0 and 1, got {self.max_bad_fraction}")
        self.check_stream_flags()
        if self.streams_training():
            map_style_only = {
                "--max_train_samples": self.max_train_samples is not None,
                "--caption_sampling one_per_image": self.caption_sampling == "one_per_image",
            }
            for flag, given in map_style_only.items():
                if given:
                    raise ConfigError(
                        f"{flag} needs a map-style training split; a stream is read in the order of its shards: "
                        "bound the run with --max_steps instead, or drop --streaming"
                    )
        if self.mediapipe_dataloader:
            self.decode_on_device = True  # run_bridgetower.py's device-side decode (Gaudi MediaPipe) -> nvJPEG


@dataclass
class EvalArguments:
    """``vlfit eval``'s run settings: the ``TrainingArguments`` flags that evaluation uses, under their names."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Where eval_results.json goes (default: the model folder)."}
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Pairs per batch on each process."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "Loader worker processes (0: in the main one)."})
    dataloader_prefetch_factor: int | None = field(default=None, metadata={"help": "Batches each worker prepares."})
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin host batches (faster copies to a GPU)."})
    bf16: bool = field(default=False, metadata={"help": "Run the model under bf16 autocast."})
    use_cpu: bool = field(default=False, metadata={"help": "Run on the CPU even when a GPU is there."})
    seed: int = field(default=42, metadata={"help": "Seed (pools are drawn in order; this seeds the rest)."})
    report_to: str = field(default="none", metadata={"help": "Where to log metrics (none, tensorboard, wandb...)."})
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bars."})
    ddp_backend: str | None = field(default=None, metadata={"help": "Under torchrun: nccl, gloo (CPUs)..."})

    def __post_init__(self) -> None:
        if int(self.per_device_eval_batch_size) < 1:
            raise ConfigError(f"--per_device_eval_batch_size must be at least 1, got {self.per_device_eval_batch_size}")
        if int(self.dataloader_num_workers) < 0:
            raise ConfigError(f"--dataloader_num_workers must be at least 0, got {self.dataloader_num_workers}")
