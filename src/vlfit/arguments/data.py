"""Where the image-text pairs come from (``DataLocationArguments``), how a streamed training split is read
(``StreamArguments``) and how samples become model inputs (``DataArguments``: all three, with run_bridgetower.py's
compatibility flags)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vlfit.arguments.sizes import check_sizes
from vlfit.compat_flags import CompatDataFlags
from vlfit.data.bad_samples import BAD_SAMPLE_POLICIES, MIN_SAMPLES_FOR_BAD_FRACTION, check_bad_sample_policy
from vlfit.data.columns import DEFAULT_COLUMNS, is_default_column
from vlfit.data.file_patterns import is_stream_spec
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.inference.rerank_score import RERANK_SCORES, check_rerank_score, check_rerank_weight
from vlfit.models.reference import parse_model_reference

if TYPE_CHECKING:
    from vlfit.data.stream.shards import ShardReader

logger = logging.getLogger(__name__)

# The CPU-stage pipelines (--image_pipeline): vlfit.data.image_transforms implements each.
IMAGE_PIPELINES = ("fast", "reference")
# How a training epoch walks several captions per image (vlfit.data.caption_sampling).
CAPTION_SAMPLING = ("every", "one_per_image")
# What a run fine-tunes for (--task): image-text retrieval, or visual question answering (BridgeTower).
TASKS = ("retrieval", "vqa")

# The data-location flags that say how shard URLs are read rather than where the data is.
SHARD_ACCESS = ("storage_options", "shard_block_size")


@dataclass
class DataLocationArguments:
    """Where the image-text pairs come from and which columns hold them (shared by train, eval and prepare)."""

    dataset_name: str | None = flag(
        None,
        "A hub dataset id (e.g. jmhessel/newyorker_caption_contest), a folder written by save_to_disk "
        "(e.g. by `vlfit make-data`), a folder of parquet, jsonl, json, csv or tar files (split by name, e.g. by "
        "`vlfit prepare`), or such files themselves (a path, glob or {a..b} pattern: split train).",
    )
    dataset_config_name: str | None = flag(None, "Hub dataset config (e.g. matching).")
    dataset_revision: str | None = flag(None, "Hub dataset branch, tag or commit.")
    data_dir: str | None = flag(None, "data_dir passed to datasets.load_dataset.")
    train_file: str | None = flag(
        None, "Training data: parquet, jsonl/json or csv (image paths relative to it), or .tar shards."
    )
    validation_file: str | None = flag(
        None, "Validation data, same formats; shard URLs (https://, s3://...) are read from local copies."
    )
    test_file: str | None = flag(None, "Test data, same formats.")
    image_column: str = flag(
        DEFAULT_COLUMNS["image"][0],
        "Column holding images (bytes, paths or PIL). Not given: the first of "
        f"{', '.join(DEFAULT_COLUMNS['image'])} that the data has.",
    )
    caption_column: str = flag(
        DEFAULT_COLUMNS["caption"][0],
        "Column holding the captions. Not given: the first of "
        f"{', '.join(DEFAULT_COLUMNS['caption'])} that the data has.",
    )
    id_column: str | None = flag(None, "Column with sample ids (default: instance_id or id if present, else row).")
    image_id_column: str | None = flag(
        None,
        "Column naming the image a row shows (e.g. COCO's image_id): rows with equal values are captions "
        "of one image, for evaluation (recall over unique images) and the loss (never each other's negatives). "
        "Default: rows with identical image bytes are one image. A caption column holding lists of captions is "
        "read as one row per caption.",
    )

    storage_options: str | None = flag(
        None,
        "Shard URLs: fsspec storage options, a JSON object (headers, auth, client_kwargs, block_size...), "
        'e.g. \'{"headers": {"Authorization": "Bearer ..."}}\'; every command that reads shard URLs uses them.',
    )
    shard_block_size: int | None = flag(
        None,
        "Shard URLs: bytes fetched per HTTP Range request (fsspec's block_size). 0: each shard is one "
        "whole-file GET, for servers that ignore Range requests (otherwise detected on the first such answer).",
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
        from vlfit.data.stream.urls import parse_storage_options  # the stream package imports torch

        return parse_storage_options(self.storage_options)

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

    streaming: bool = flag(
        False,
        "Stream the training split shard by shard instead of opening it as a map-style dataset: "
        "--train_file tar shards (local, or implied by URLs and '::' sources), or --dataset_name's data files "
        "(a hub id or a local folder of parquet or tar shards). Needs --max_steps: a stream has no length.",
    )
    train_data_weights: str | None = flag(
        None,
        "Comma-separated weights of the '::'-separated sources of --train_file (open_clip's upsampling "
        "factors): samples are drawn from each source in proportion. Default: all 1.",
    )
    shuffle_buffer: int = flag(
        1000,
        "Samples each loader worker's shuffle buffer holds when streaming (0: shard order, no shuffle); "
        "shard order is shuffled per epoch too. Deterministic per --seed.",
    )
    resampled: bool = flag(
        False,
        "Streaming: draw shards with replacement, endlessly (open_clip's --dataset-resampled), instead "
        "of reading each shard once per epoch.",
    )
    shard_retries: int = flag(
        3,
        "Streaming: times a failing shard (HTTP error, dropped connection, timeout) is tried again, with "
        "backoff, before it is given up and counted as a bad sample under --max_bad_fraction.",
    )
    shard_timeout: float = flag(60.0, "Streaming: seconds a connection or one read may take before it is a fault.")

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

    max_seq_length: int | None = flag(
        None,
        "Captions are truncated to this many tokens (default: the length the model was trained with "
        "when it is a vlfit run, from its input_spec.json; else 128, within the model's text positions).",
    )
    max_num_patches: int | None = flag(
        None,
        "NaFlex models (SigLIP 2): each image keeps its aspect ratio as at most this many patches, "
        "the token budget (default: the budget the model was trained with when it is a vlfit run, from its "
        "input_spec.json; else its image processor's, 256 for SigLIP 2).",
    )
    max_train_samples: int | None = flag(None, "Use only the first N training samples.")
    max_eval_samples: int | None = flag(None, "Use only the first N evaluation samples.")
    preprocessing_num_workers: int | None = flag(
        None, "Accepted for run_bridgetower.py compatibility; vlfit preprocesses lazily."
    )
    image_pipeline: str = flag(
        "fast",
        "fast: DCT-scaled decode and uint8 resize in workers, normalize on the device. "
        "reference: run_bridgetower.py's Pillow/float pipeline, all on the CPU.",
        choices=IMAGE_PIPELINES,
    )
    decode_on_device: bool = flag(
        False, "Workers only read bytes; JPEGs are decoded on the GPU with nvJPEG (CPU fallback)."
    )
    random_resized_crop: bool = flag(False, "Random resized crop (fast pipeline).")
    horizontal_flip: bool = flag(False, "Random horizontal flip, on the device.")
    hard_negative_column: str | None = flag(
        None,
        "A column of alternative captions per sample (a list of strings, e.g. caption_choices of the "
        "New Yorker matching config or of `vlfit make-data` data): training also scores each image against "
        "its own alternatives, beside the batch's captions (NegCLIP's hard negatives). The sample's own choice "
        "is left out: the one its label column points to, or else any equal to its caption.",
    )
    caption_sampling: str = flag(
        "every",
        "How a training epoch walks several captions per image: every (each caption once per epoch) or "
        "one_per_image (each image once per epoch, with one of its captions drawn anew each epoch).",
        choices=CAPTION_SAMPLING,
    )
    eval_split: str = flag("validation", "Split that --do_eval evaluates.")
    eval_pool_size: int | None = flag(None, "Recall@k over pools of this many images (default: the whole split).")
    rerank_top_k: int | None = flag(
        None,
        "Evaluation: also re-rank each query's top K candidates by the model's image-text matching head "
        "(BridgeTower with one), both directions, and report recall@k re-ranked beside the cosine ranking.",
    )
    rerank_score: str | None = flag(
        None,
        "Evaluation's re-ranking (--rerank_top_k): also report recall with the candidates ordered by "
        "itm+itc (the matching log-odds plus --rerank_weight times the cosine; its metrics are named fused), or "
        "by itm alone. Default: itm+itc when the model's run saved a weight (rerank.json), else itm.",
        choices=RERANK_SCORES,
    )
    rerank_weight: float | None = flag(
        None, "The cosine's weight in itm+itc re-ranking (default: the one the model's run saved)."
    )
    save_rerank_weight: bool = flag(
        False,
        "vlfit eval: sweep the itm+itc weight on this split (re-ranking the top --rerank_top_k, or 16) "
        "and save the best into the model folder (rerank.json), where vlfit eval, retrieve query, serve and "
        "vlfit.Index read it. vlfit train does it at the end of every run with a matching head and a "
        "validation split.",
    )
    zeroshot_dataset: list[str] | None = flag(
        None,
        "Labelled data to classify zero-shot at every evaluation (any data source form; several may be "
        "given): top-1/top-5 accuracy logged beside the retrieval metrics as eval_zeroshot_top1 (with several, "
        "eval_zeroshot_<name>_top1), to watch what fine-tuning forgets.",
    )
    zeroshot_label_column: str = flag("label", "The class column of --zeroshot_dataset (a ClassLabel or text).")
    zeroshot_split: str = flag("test", "The split of --zeroshot_dataset to classify.")
    prompt_template: list[str] | None = flag(
        None,
        "Zero-shot prompts, '{}' the class name; several are averaged (default: vlfit fewshot's five, "
        "'a photo of a {}.', ...).",
    )
    bad_sample_policy: str = flag(
        "skip",
        "What to do with a sample whose image cannot be read or decoded or whose caption is missing, "
        "empty or whitespace. skip: training replaces it by another sample (batches keep their size), "
        "evaluation leaves it out; each is logged and listed in bad_samples.jsonl. raise: stop with an error "
        "naming the sample.",
        choices=BAD_SAMPLE_POLICIES,
    )
    max_bad_fraction: float = flag(
        0.01,
        "With --bad_sample_policy skip, stop training once more than this fraction of the samples read "
        f"so far were bad (judged after max({MIN_SAMPLES_FOR_BAD_FRACTION}, 1/fraction) samples, or once a "
        "smaller split was read whole). "
        "0: the first bad sample stops the run; 1: never stop.",
    )

    task: str = flag(
        "retrieval",
        "retrieval (image-text contrastive fine-tuning, recall@k) or vqa (BridgeTower: a classifier over "
        "the fused tower answers each row's question, the caption column, default question; answers from "
        "answers or multiple_choice_answer; VQA accuracy). vlfit eval of a vqa model needs no flag.",
    )
    max_answers: int = flag(3129, "--task vqa: the answer vocabulary, the N answers the training split gives most.")
    answer_vocabulary: str | None = flag(
        None,
        "--task vqa: a file of the answers the classifier chooses from, in place of the --max_answers "
        "most given in the training split: one answer per line, a JSON list, or a JSON {answer: index} map "
        "(METER's and ViLT's ans2label). What a streamed training split needs.",
    )

    def run_task(self, model_name_or_path: str | None) -> str:
        """The run's task: ``--task``, or ``vqa`` for a VQA model's folder (``vlfit eval`` of a ``--task vqa`` run
        needs no flag)."""
        folder = model_name_or_path if self.task == "retrieval" and model_name_or_path else None
        if folder and os.path.isdir(folder) and parse_model_reference(folder).answers_questions:
            logger.info("%s is a BridgeTower VQA model: the run answers questions (--task vqa)", folder)
            return "vqa"
        return self.task

    def run_source_kwargs(self, task: str) -> dict[str, Any]:
        """``source_kwargs`` of a run of ``task`` (``--task``, or ``vqa`` for a VQA model's folder): a VQA run's
        caption is the question unless ``--caption_column`` names a column."""
        location = self.source_kwargs()
        if task == "vqa" and is_default_column("caption", self.caption_column):
            from vlfit.data.vqa import QUESTION_COLUMN  # the VQA data module imports torch

            location["caption_column"] = QUESTION_COLUMN
        return location

    def __post_init__(self) -> None:
        DataLocationArguments.__post_init__(self)
        check_sizes(self)  # --max_seq_length, --max_num_patches, --eval_pool_size ... (vlfit.arguments.sizes)
        if self.task not in TASKS:
            raise ConfigError(f"unknown --task {self.task!r}; choose one of: {', '.join(TASKS)}")
        check_rerank_score(self.rerank_score)
        check_rerank_weight(self.rerank_weight)
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
            for option, given in map_style_only.items():
                if given:
                    raise ConfigError(
                        f"{option} needs a map-style training split; a stream is read in the order of its shards: "
                        "bound the run with --max_steps instead, or drop --streaming"
                    )
        if self.mediapipe_dataloader:
            self.decode_on_device = True  # run_bridgetower.py's device-side decode (Gaudi MediaPipe) -> nvJPEG
