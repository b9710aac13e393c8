"""``vlfit train`` on a streamed training split: shards over loopback HTTP train as the same shards read locally,
a run stopped by SIGTERM and resumed logs the uninterrupted run's losses (across an epoch of the stream), a shard
that fails is a bad sample under ``--max_bad_fraction``, and flags that a stream cannot honour are refused."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from tests.http_shards import ShardServer, webdataset_shard
from tests.training.train_runs import SigtermAtStep, logged_losses, single_torch_thread, tiny_train_argv
from vlfit.arguments import DataArguments
from vlfit.cli import main
from vlfit.commands import train as train_command
from vlfit.errors import ConfigError
from vlfit.training.run import run
from vlfit.training.stream_epochs import agreed_batches

# Two sources of 2 shards each, weighted 1:3. 4 x 24 samples at batch 6 is an epoch of 16 steps: 20 steps cross
# into the stream's second epoch.
SHARDS, PER_SHARD, STEPS, STOP_AT = 4, 24, 20, 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    folder = tmp_path_factory.mktemp("shards")
    served = {}
    for i in range(SHARDS):
        data, _ = webdataset_shard(f"s{i}", PER_SHARD, seed=i, size=32)
        (folder / f"{i:03d}.tar").write_bytes(data)
        served[f"/s/{i:03d}.tar"] = data
    return folder, served


def _spec(root: str) -> str:
    return f"{root}/{{000..001}}.tar::{root}/{{002..003}}.tar"


def _argv(spec: str, out: Path, *extra: str) -> list[str]:
    flags = ["--train_file", spec, "--train_data_weights", "1,3", "--shuffle_buffer", "10", "--caption_column", "txt"]
    argv = tiny_train_argv("unused", out, *flags, *extra, steps=STEPS, workers=2)
    i = argv.index("--dataset_name")
    return argv[:i] + argv[i + 2 :]  # the stream is the only data


@pytest.mark.slow
def test_streamed_over_http_trains_as_read_locally_and_resumes_after_sigterm_exactly(
    tmp_path: Path, shards: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, served = shards
    straight = tmp_path / "straight"
    assert main(["train", *_argv(_spec(str(folder)), straight, "--streaming", "--save_strategy", "no")]) == 0
    expected = logged_losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))

    out = tmp_path / "run"
    with ShardServer(served) as server:
        argv = _argv(_spec(server.url("/s")), out, "--save_strategy", "no")  # URLs: streamed without --streaming

        def run_with_a_sigterm(*args, callbacks=(), **kwargs):
            return run(*args, callbacks=[*callbacks, SigtermAtStep(STOP_AT)], **kwargs)

        monkeypatch.setattr(train_command, "run", run_with_a_sigterm)
        assert main(["train", *argv]) == 128 + signal.SIGTERM
        monkeypatch.undo()
        (checkpoint,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
        state = json.loads((checkpoint / "stream_state.json").read_text())
        assert state["epoch"] == 0 and state["num_workers"] == 2 and set(state["workers"]) == {"0", "1"}
        interrupted = logged_losses(checkpoint)
        assert max(interrupted) == STOP_AT + 1  # the handler stops at the end of the step in progress
        assert all(interrupted[s] == pytest.approx(expected[s], abs=1e-6) for s in interrupted)  # HTTP = local

        assert main(["train", *argv]) == 0  # resumed from the checkpoint it finds in --output_dir
    resumed = logged_losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    diffs = {s: abs(resumed[s] - expected[s]) for s in expected}
    assert max(diffs.values()) <= 1e-6, diffs  # the same batches after the resume, into the stream's next epoch
    assert _logged_epochs(out) == _logged_epochs(straight)  # 0.55 after the resume at step 10, not 0.05 again


def _logged_epochs(output_dir: Path) -> dict[int, float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: round(entry["epoch"], 6) for entry in history if "loss" in entry}


@pytest.mark.slow
def test_a_failing_shard_is_a_bad_sample_under_max_bad_fraction(
    tmp_path: Path, shards: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, served = shards
    with ShardServer(served) as server:
        server.fail("/s/001.tar", status=500)  # every request, every retry

        def argv(out: str, max_bad_fraction: str) -> list[str]:
            flags = ["--train_file", server.url("/s/{000..003}.tar"), "--shard_retries", "0", "--caption_column", "txt",
                     "--save_strategy", "no", "--max_bad_fraction", max_bad_fraction]  # fmt: skip
            return [
                a
                for a in tiny_train_argv("unused", tmp_path / out, *flags, steps=6)
                if a not in ("--dataset_name", "unused")
            ]

        assert main(["train", *argv("lenient", "1")]) == 0
        metrics = json.loads((tmp_path / "lenient" / "train_results.json").read_text())
        assert metrics["train_bad_samples"] == 1  # the shard, once
        (bad,) = [json.loads(line) for line in (tmp_path / "lenient" / "bad_samples.jsonl").read_text().splitlines()]
        assert bad["id"] == server.url("/s/001.tar") and "500" in bad["reason"], bad

        assert main(["train", *argv("strict", "0")]) != 0  # the first bad sample stops the run, naming the shard
        assert server.url("/s/001.tar") in capsys.readouterr().err


@pytest.mark.slow
def test_a_lost_shard_or_source_of_a_mix_ends_the_run_naming_them(
    tmp_path: Path, shards: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, served = shards
    html = b"<!DOCTYPE html><html><body>" + b"Moved. " * 100 + b"</body></html>"
    with ShardServer({**served, "/h/page.tar": html}) as server:
        server.files.pop("/s/003.tar")  # 404: one shard of four
        flags = ["--train_file", f"{server.url('/s/{000..003}.tar')}::{server.url('/h/page.tar')}",
                 "--train_data_weights", "1,1", "--caption_column", "txt", "--save_strategy", "no"]  # fmt: skip
        argv = [
            a
            for a in tiny_train_argv("unused", tmp_path / "out", *flags, steps=6)
            if a not in ("--dataset_name", "unused")
        ]
        assert main(["train", *argv]) == 2  # --max_bad_fraction 0.01 of the shards asked for, judged at once
    err = capsys.readouterr().err
    assert "1 of the 1 shards of" in err and server.url("/h/page.tar") in err
    heads = [path for method, path, _ in server.requests if method == "HEAD"]
    # the reachability check, the tokenizer's captions, then training: no retries (--shard_retries 3)
    assert heads.count("/h/page.tar") == 3


def test_a_source_whose_server_is_down_is_named_in_one_line_before_any_tokenizer_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ShardServer({}) as gone:
        spec = gone.url("/s/{000..003}.tar")
    flags = ["--train_file", spec, "--caption_column", "txt", "--shard_retries", "1"]
    argv = [
        a for a in tiny_train_argv("unused", tmp_path / "out", *flags, steps=4) if a not in ("--dataset_name", "unused")
    ]
    assert main(["train", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "cannot reach the server of " + gone.url("/s/000.tar") in line and "tokenizer" not in line


class ServerDownAtStep(TrainerCallback):
    """Takes the shard server down at the end of training step ``step`` (new connections refused, open ones cut)."""

    def __init__(self, server: ShardServer, step: int) -> None:
        self.server, self.step = server, step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            self.server.down()


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_it_with_a_checkpoint_the_rerun_resumes_exactly(
    tmp_path: Path, shards: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    folder, served = shards
    steps, down_at = 8, 2  # 8 x 6 samples + a buffer of 10 read 3 of the 4 shards: the third opens at batch 7

    def argv(spec: str, out: Path) -> list[str]:
        flags = ["--train_file", spec, "--shuffle_buffer", "10", "--caption_column", "txt", "--shard_retries", "1",
                 "--shard_timeout", "10", "--save_strategy", "no", "--streaming"]  # fmt: skip
        return [
            a
            for a in tiny_train_argv("unused", out, *flags, steps=steps, workers=1)
            if a not in ("--dataset_name", "unused")
        ]

    straight = tmp_path / "straight"
    assert main(["train", *argv(f"{folder}/{{000..003}}.tar", straight)]) == 0
    expected = logged_losses(straight)

    out = tmp_path / "run"
    with ShardServer(served) as server:
        run_argv = argv(server.url("/s/{000..003}.tar"), out)

        def run_until_the_server_dies(*args, callbacks=(), **kwargs):
            return run(*args, callbacks=[*callbacks, ServerDownAtStep(server, down_at)], **kwargs)

        monkeypatch.setattr(train_command, "run", run_until_the_server_dies)
        assert main(["train", *run_argv]) == 2
        monkeypatch.undo()
        (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
        assert "the training data's source became unreachable" in line and "Rerun the same command" in line, line
        (checkpoint,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
        stopped = int(checkpoint.name.split("-")[1])
        assert f"saved checkpoint {checkpoint} at step {stopped}" in line
        assert down_at <= stopped < steps  # the batches read before the server died were trained on
        assert sorted(logged_losses(checkpoint)) == list(range(1, stopped + 1))

        server.up()
        assert main(["train", *run_argv]) == 0  # resumed from the checkpoint it finds in --output_dir
    resumed = logged_losses(out)
    assert sorted(resumed) == list(range(1, steps + 1))
    diffs = {s: abs(resumed[s] - expected[s]) for s in expected}
    assert max(diffs.values()) <= 1e-6, diffs  # nothing read twice or skipped around the stop


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"train_file": "a.parquet", "train_data_weights": "1,3"}, "--train_data_weights weights the '::' sources"),
        ({"train_file": "a/{0..1}.tar::b.tar", "max_train_samples": 10}, "--max_train_samples needs a map-style"),
        ({"streaming": True, "caption_sampling": "one_per_image"}, "--caption_sampling one_per_image needs"),
        ({"streaming": True, "shuffle_buffer": -1}, "--shuffle_buffer must be 0"),
    ],
)
def test_flags_a_stream_cannot_honour_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataArguments(**flags)


def test_a_stream_needs_max_steps_and_a_worker_count(
    tmp_path: Path, shards: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _ = shards
    argv = _argv(_spec(str(folder)), tmp_path / "out")
    no_steps = list(argv)
    no_steps[no_steps.index("--max_steps") + 1] = "-1"
    assert main(["train", *no_steps]) == 2
    assert "a streamed training split has no length: give --max_steps" in capsys.readouterr().err
    workers = list(argv)
    workers[workers.index("--dataloader_num_workers") + 1] = "auto"
    assert main(["train", *workers]) == 2
    assert "resumes only with the worker count it was saved with" in capsys.readouterr().err


# ------------------------------------------------------------------------------- on two processes (tests.two_processes)


def two_process_payload() -> dict:
    return {"counts": [3, 1]}  # rank 1's share of the epoch ran out first


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        counts = torch.load(payload_path)["counts"]
        agreed = [agreed_batches(counts[rank], torch.device("cpu")), agreed_batches(2, torch.device("cpu"))]
        torch.save({"agreed": agreed}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_processes_agree_on_the_fewest_batches_any_has(two_process_results) -> None:
    results = two_process_results["tests.training.test_stream_training"]
    assert [r["agreed"] for r in results] == [[1, 2], [1, 2]]  # both end the epoch when one runs out
    assert agreed_batches(3, torch.device("cpu")) == 3  # one process: its own count


@pytest.mark.slow
@pytest.mark.slow
def test_a_short_streamed_run_that_lost_too_many_samples_ends_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import tarfile

    from tests.data.image_factory import jpeg_bytes

    for shard in range(2):  # 3 of every 8 images do not decode: far over --max_bad_fraction, in a run of ~20 reads
        with tarfile.open(tmp_path / f"{shard:03d}.tar", "w") as archive:
            for i in range(8):
                image = b"not a jpeg" if i % 3 == 0 else jpeg_bytes(32, 32, seed=10 * shard + i)
                for ext, data in (("jpg", image), ("txt", f"sample {i} of shard {shard}".encode())):
                    info = tarfile.TarInfo(f"s{shard}-{i:04d}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
    flags = ["--train_file", f"{tmp_path}/{{000..001}}.tar", "--streaming", "--save_strategy", "no",
             "--max_bad_fraction", "0.1"]  # fmt: skip
    argv = [
        a for a in tiny_train_argv("unused", tmp_path / "out", *flags, steps=2) if a not in ("--dataset_name", "unused")
    ]
    assert main(["train", *argv]) == 2  # fewer than 100 reads: judged at the end, not waved through
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "samples the run read were bad" in line and "--max_bad_fraction 0.1" in line, line
    assert (tmp_path / "out" / "bad_samples.jsonl").is_file() and not (tmp_path / "out" / "model.safetensors").exists()
