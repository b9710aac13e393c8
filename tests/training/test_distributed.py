"""Multi-process training on CPUs: `vlfit train` under torchrun (2 gloo processes on one launcher, and two launchers
as two simulated nodes), and the launch checks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    BridgeTowerForContrastiveLearning,
    BridgeTowerForImageAndTextRetrieval,
)

from tests.training.recording import weights_digest
from tests.training.train_runs import free_port, run_torchrun, torchrun_env
from vlfit.cli import main
from vlfit.training import throughput
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.distributed import describe_launch
from vlfit.training.throughput import ThroughputMeter

RECORDING = str(Path(__file__).with_name("recording.py"))
NUM_SAMPLES = 30  # not a multiple of the global batch of 2 x 4: the epoch has an uneven tail
TIMEOUT = 240  # a guard against hangs, far above the time a run takes


def _torchrun_train(record_dir: Path, flags: list[str]) -> list[dict]:
    record_dir.mkdir()
    done = run_torchrun(RECORDING, "train", *flags, env=torchrun_env(VLFIT_RECORD_DIR=str(record_dir)), timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((record_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def _run_together(record_dir: Path, commands: list[tuple[list[str], dict[str, str]]]) -> list[dict]:
    """Start every ``(argv, extra environment)`` at once, each in a session of its own with no stdin, wait for all
    (each must exit 0), and return what each rank recorded in ``record_dir``."""
    record_dir.mkdir()
    processes = [
        subprocess.Popen(argv, env=torchrun_env(VLFIT_RECORD_DIR=str(record_dir), **extra), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for argv, extra in commands
    ]  # fmt: skip
    outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    return [json.loads((record_dir / f"rank{rank}.json").read_text()) for rank in range(len(commands))]


def _two_node_train(record_dir: Path, flags: list[str]) -> list[dict]:
    """Two machines simulated on one: two torchrun launchers (``--nnodes 2``, one process each) meeting at a c10d
    rendezvous on localhost, as the same command started on two machines does (docs/multi-node.md)."""
    endpoint = f"localhost:{free_port()}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "two-nodes"]  # fmt: skip
    return _run_together(
        record_dir, [([*launcher, "--node_rank", str(node), RECORDING, "train", *flags], {}) for node in range(2)]
    )


def _common(dataset_dir: str, output_dir: Path) -> list[str]:
    return ["--model_preset", "tiny", "--dataset_name", dataset_dir, "--max_train_samples", str(NUM_SAMPLES),
            "--output_dir", str(output_dir), "--num_train_epochs", "2", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--save_strategy", "no", "--dataloader_num_workers", "1",
            "--logging_steps", "2"]  # fmt: skip


def _ids_per_epoch(records: list[dict]) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for record in records:
        for batch in record["batches"]:
            seen.setdefault(batch["epoch"], Counter()).update(batch["ids"])
    return seen


@pytest.fixture(scope="module")
def train_ids(synthetic_dataset_dir) -> set[str]:
    return set(datasets.load_from_disk(synthetic_dataset_dir)["train"]["instance_id"][:NUM_SAMPLES])


def _shared_flags(dataset_dir: str, output_dir: Path) -> list[str]:
    """The run both the DDP and the FSDP launches make, so their losses can be compared."""
    return [*_common(dataset_dir, output_dir), "--contrastive_negatives", "global", "--do_eval",
            "--dataloader_drop_last"]  # fmt: skip


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, synthetic_dataset_dir) -> tuple[Path, list[dict]]:
    """Two launchers (two simulated nodes, one process each), global negatives and --dataloader_drop_last."""
    folder = tmp_path_factory.mktemp("ddp")
    records = _two_node_train(folder / "records", _shared_flags(synthetic_dataset_dir, folder / "model"))
    return folder / "model", records


@pytest.mark.slow
def test_two_nodes_with_global_negatives_shard_the_data_and_rank0_writes_the_checkpoint(
    tmp_path, synthetic_dataset_dir, train_ids, ddp_run, capsys
):
    out, records = ddp_run
    assert [r["world_size"] for r in records] == [2, 2]
    assert [r["should_save"] for r in records] == [True, False]  # only rank 0 writes
    # Each process reads its own share: 3 steps of 4 per epoch. 30 samples fill 3 full global batches of 8: the
    # 6 samples of the incomplete one are left out, none is repeated.
    for record in records:
        assert [len(b["ids"]) for b in record["batches"]] == [4] * 6
    seen = _ids_per_epoch(records)
    assert sorted(seen) == [0, 1]
    for epoch, counts in seen.items():
        assert set(counts) <= train_ids and len(counts) == 24 and max(counts.values()) == 1, epoch
    assert records[0]["batches"][0]["ids"] != records[0]["batches"][3]["ids"]  # each epoch is reshuffled
    # DDP kept the processes' weights equal, and both trained the same tokenizer.
    assert records[0]["weights_sha256"] == records[1]["weights_sha256"]
    assert records[0]["vocab_sha256"] == records[1]["vocab_sha256"]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in records)

    # The checkpoint rank 0 wrote loads back and holds the trained weights.
    model = BridgeTowerForContrastiveLearning.from_pretrained(out)
    assert weights_digest(model.state_dict()) == records[0]["weights_sha256"]
    assert AutoTokenizer.from_pretrained(out)("two red circles")["input_ids"]
    assert AutoImageProcessor.from_pretrained(out).size

    # Distributed evaluation scores each validation sample once, like one process does.
    distributed = json.loads((out / "eval_results.json").read_text())
    assert distributed["eval_num_samples"] == 8
    capsys.readouterr()
    assert main(["eval", "--model_name_or_path", str(out), "--dataset_name", synthetic_dataset_dir,
                 "--output_dir", str(tmp_path / "eval"), "--report_to", "none"]) == 0  # fmt: skip
    single = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    for key in ("eval_num_samples", "eval_t2i_recall@5", "eval_i2t_recall@5", "eval_matching_accuracy"):
        assert distributed[key] == pytest.approx(single[key]), key


@pytest.mark.slow
def test_srun_tasks_train_as_torchrun_processes_do(tmp_path, synthetic_dataset_dir, ddp_run):
    """Two processes started as ``srun --ntasks 2`` starts them (SLURM's variables, none of torch's, no launcher)
    train on the same shares and log the same losses as the two torchrun processes."""
    port = str(free_port())
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": port}  # fmt: skip
    argv = [sys.executable, RECORDING, "train", *_shared_flags(synthetic_dataset_dir, tmp_path / "model")]
    records = _run_together(
        tmp_path / "records",
        [(argv, {**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)}) for task in range(2)],
    )
    _, torchrun_records = ddp_run
    assert [r["world_size"] for r in records] == [2, 2]
    for srun, torchrun in zip(records, torchrun_records, strict=True):
        assert [b["ids"] for b in srun["batches"]] == [b["ids"] for b in torchrun["batches"]]
        assert srun["losses"] == pytest.approx(torchrun["losses"], rel=1e-5)


def test_slurm_variables_become_torchs_only_for_the_tasks_of_a_step():
    from vlfit.launch import adopt_slurm_environment, first_host

    step = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    assert adopt_slurm_environment(step)
    assert {k: step[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                 "MASTER_PORT")} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu07",
                                                     "MASTER_PORT": "18456"}  # fmt: skip
    batch_script = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}  # sbatch's own process
    under_torchrun = {**step, "RANK": "0", "WORLD_SIZE": "2"}  # srun ... torchrun: torch's variables win
    assert not adopt_slurm_environment(batch_script) and "RANK" not in batch_script
    assert not adopt_slurm_environment(under_torchrun) and under_torchrun["WORLD_SIZE"] == "2"
    assert [first_host(n) for n in ("node[01-04,07],gpu5", "gpu5", "x[009-010]", "n1,n2", "")] == [
        "node01", "gpu5", "x009", "n1", ""]  # fmt: skip


FSDP_LAYERS = ["BridgeTowerTextLayer", "BridgeTowerResidualAttention"]  # each its own shard group
FSDP_FLAGS = ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
              json.dumps({"fsdp_version": 2, "transformer_layer_cls_to_wrap": FSDP_LAYERS})]  # fmt: skip


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_trains_the_matching_objective_and_hard_negatives_as_ddp(
    tmp_path, synthetic_dataset_dir
):
    """Under FSDP2 each process holds shards; --objective contrastive+itm scores mined negatives with the fused
    tower, and --hard_negative_column embeds each row's alternative captions, outside the root forward: the losses are
    DDP's (same flags, same data), rank 0 saves the full weights with the matching head, and evaluation scores each
    sample once, as DDP's did."""
    itm = ["--objective", "contrastive+itm", "--num_train_epochs", "1", "--hard_negative_column", "caption_choices"]
    ddp = _torchrun_train(tmp_path / "ddp", [*_shared_flags(synthetic_dataset_dir, tmp_path / "ddp_model"), *itm])
    flags = [*_shared_flags(synthetic_dataset_dir, tmp_path / "model"), *itm, *FSDP_FLAGS]
    fsdp = _torchrun_train(tmp_path / "fsdp", flags)
    assert all(r["sharded_parameters"] > 0 for r in fsdp) and all(r["sharded_parameters"] == 0 for r in ddp)
    for d, f in zip(ddp, fsdp, strict=True):
        assert len(f["losses"]) == 3
        torch.testing.assert_close(torch.tensor(f["losses"]), torch.tensor(d["losses"]), rtol=1e-5, atol=1e-6)
    # Rank 0 wrote a plain checkpoint of the full weights (the logit scale 0-d again, as transformers has it).
    saved = BridgeTowerForImageAndTextRetrieval.from_pretrained(tmp_path / "model").state_dict()
    ddp_saved = BridgeTowerForImageAndTextRetrieval.from_pretrained(tmp_path / "ddp_model").state_dict()
    assert saved.keys() == ddp_saved.keys() and "itm_score.fc.weight" in saved
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, ddp_saved[name], rtol=1e-4, atol=1e-5, msg=name)
    assert BridgeTowerForContrastiveLearning.from_pretrained(tmp_path / "model").logit_scale.shape == torch.Size([])
    fsdp_eval = json.loads((tmp_path / "model" / "eval_results.json").read_text())
    ddp_eval = json.loads((tmp_path / "ddp_model" / "eval_results.json").read_text())
    for key in ("eval_num_samples", "eval_t2i_recall@5", "eval_i2t_recall@5"):
        assert fsdp_eval[key] == pytest.approx(ddp_eval[key]), key


def test_fsdp_in_one_process_stops_in_one_line(tmp_path, synthetic_dataset_dir, capsys):
    assert main(["train", *_common(synthetic_dataset_dir, tmp_path / "o"), *FSDP_FLAGS]) == 2
    assert "--fsdp shards the model over processes: launch at least two" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_unreachable_rendezvous_fails_within_ddp_timeout(tmp_path, synthetic_dataset_dir, monkeypatch, capsys):
    port = free_port()  # nobody listens there
    # Process 1 of a launch whose process 0 never started: in this process, as the CLI runs it.
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main(["train", *_common(synthetic_dataset_dir, tmp_path / "o"), "--ddp_timeout", "1"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfit ")]
    assert f"could not form the gloo process group with 127.0.0.1:{port} within --ddp_timeout 1 s" in line
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "o").exists()  # nothing was done


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_nccl_without_gpus_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--ddp_backend nccl needs GPUs and this machine has no GPU"):
        VlfitTrainingArguments(output_dir=str(tmp_path), ddp_backend="nccl", report_to="none")


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a machine without accelerators")
def test_a_machine_without_accelerators_trains_on_cpu_and_accepts_bf16(tmp_path):
    # transformers alone refuses --bf16 here without --use_cpu, and treats torchrun processes as separate runs.
    args = VlfitTrainingArguments(output_dir=str(tmp_path), bf16=True, report_to="none")
    assert args.use_cpu and args.device.type == "cpu"


def test_unknown_negatives_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown --contrastive_negatives 'batch'"):
        VlfitTrainingArguments(output_dir=str(tmp_path), contrastive_negatives="batch", report_to="none")


def _launch_args(**overrides: object) -> SimpleNamespace:
    values = {"world_size": 2, "process_index": 0, "device": "cpu", "per_device_train_batch_size": 8,
              "dataloader_drop_last": False, "contrastive_negatives": "global"}  # fmt: skip
    return SimpleNamespace(**{**values, **overrides})


def test_drop_last_without_one_full_global_batch_is_refused():
    describe_launch(_launch_args(dataloader_drop_last=True), 16)
    describe_launch(_launch_args(), 10)  # without drop_last the tail is padded
    with pytest.raises(ValueError, match="10 training samples and a global batch of 16"):
        describe_launch(_launch_args(dataloader_drop_last=True), 10)


def test_throughput_counts_the_samples_of_every_process(monkeypatch):
    clock = iter([0.0, 2.0, 2.0, 4.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(processes=2)  # DDP: each of 2 processes serves 10 samples per window
    meter.add(0.5, 10)
    assert meter.window() == {"samples_per_second": 10.0, "data_wait_share": 0.25}
    meter.add(0.5, 10)
    assert meter.total() == {"samples_per_second": 10.0, "data_wait_share": 0.25}
