import os
from pathlib import Path

import pytest

from tests.built_once import built_once

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers (pytest-xdist) share the cores: one thread each
    # And so does every process a test starts (a command, a server, torchrun's ranks, a benchmark script), unless
    # the test sets its own: two OpenMP threads beside the other worker wait for each other at every operation,
    # spinning on a core the other worker needs (the text-tower benchmark's test took 20 s without this, 12-13 s
    # with it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# Session fixtures that run a whole command or process (a training run, a 2-process spawn, an export): a test that
# uses one, directly or through another fixture, is slow as well, so `make test-fast` never builds them.
SLOW_FIXTURES = frozenset({"trained_clip", "two_process_results", "onnx_export"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    """Each test draws torch's random numbers from seed 0, whatever ran before it in its worker (which depends on
    how pytest-xdist spread the files): a test's random weights and data are the same on every run."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:  # else its first import starts from its own fixed seed
        torch.manual_seed(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """No test loads OpenVINO's runtime in the test process: left there, its threads crashed a later, unrelated
    test in the same process (SIGSEGV). OpenVINO runs in processes of their own (tests/inference/openvino_checks.py)."""
    import sys

    loaded = "openvino" in sys.modules
    yield
    if not loaded and sys.modules.get("openvino") is not None:
        pytest.fail(f"{item.nodeid} loaded openvino in the test process: run it in a process of its own")


@pytest.fixture(scope="session")
def synthetic_dataset_dir(tmp_path_factory) -> str:
    """A small synthetic New-Yorker-like dataset on disk (save_to_disk format), made once per test session."""
    from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset

    path = tmp_path_factory.mktemp("synthetic") / "data"
    config = SyntheticConfig(num_samples=80, seed=3, min_long_side=160, max_long_side=320)
    save_dataset(make_dataset(config), str(path), format="arrow")
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """A tiny random-init checkpoint with its tokenizer, as ``vlfit train`` saves one (the export and index tests)."""
    from tests.inference.tiny_models import save_tiny_checkpoint

    return save_tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def other_checkpoint(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """A second tiny checkpoint: same architecture and tokenizer, other weights."""
    from tests.inference.tiny_models import save_tiny_checkpoint

    return save_tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory.mktemp("other") / "model", seed=1)


@pytest.fixture(scope="session")
def itm_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with a new image-text matching head, as ``vlfit train --objective contrastive+itm`` saves
    one (the export and re-ranking tests)."""
    from tests.inference.tiny_models import save_itm_checkpoint

    return save_itm_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("itm") / "model")


@pytest.fixture(scope="session")
def weighted_itm_checkpoint(itm_checkpoint, tmp_path_factory) -> Path:
    """A copy of ``itm_checkpoint`` whose run saved a re-ranking weight (``rerank.json``: 4.0), as a training run
    with a validation split does."""
    import shutil

    from vlfit.inference.rerank_score import save_rerank_file

    model = tmp_path_factory.mktemp("weighted") / "model"
    shutil.copytree(itm_checkpoint, model)
    save_rerank_file(str(model), {"rerank_weight": 4.0, "split": "validation"})
    return model


@pytest.fixture(scope="session")
def onnx_export(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> Path:
    """``vlfit export --quantize int8`` of the tiny checkpoint, calibrated on the synthetic dataset (built once a
    run: ``tests.built_once``)."""
    from vlfit.cli import main

    def export(folder: Path) -> None:
        assert main(["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(folder / "onnx"),
                     "--quantize", "int8", "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "13",
                     "--calibration_samples", "16"]) == 0  # fmt: skip

    return built_once(tmp_path_factory, "onnx-export", export) / "onnx"


@pytest.fixture(scope="session")
def two_process_results(synthetic_dataset_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """The 2-process gloo checks of ``tests.two_processes.MODULES``, run together once a run; results by module."""
    from tests.two_processes import read_results, run_two_processes

    return read_results(built_once(tmp_path_factory, "two-processes",
                                   lambda folder: run_two_processes(folder, synthetic_dataset_dir)))  # fmt: skip


@pytest.fixture(scope="session")
def trained_clip(synthetic_dataset_dir, tmp_path_factory):
    """clip-tiny fine-tuned on the synthetic training split until it has learned it (200 steps, seconds): a model
    whose text queries find their own images, for the retrieval and serving tests (trained once a run)."""
    from vlfit.cli import main

    def train(folder: Path) -> None:
        assert main(["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                     str(folder / "model"), "--max_steps", "200", "--per_device_train_batch_size", "16",
                     "--learning_rate", "1e-3", "--warmup_steps", "5", "--save_strategy", "no", "--report_to",
                     "none", "--seed", "0", "--logging_steps", "1000", "--disable_tqdm", "true"]) == 0  # fmt: skip

    return built_once(tmp_path_factory, "trained-clip", train) / "model"


@pytest.fixture(scope="session")
def image_folder(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The validation and test images of the synthetic dataset as JPEG files in two sub-folders, plus one file that
    is not an image."""
    from tests.inference.tiny_models import write_image_folder

    return write_image_folder(synthetic_dataset_dir, tmp_path_factory.mktemp("images"))
