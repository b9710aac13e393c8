"""The real ``vlfit serve`` process over an index damaged while it is served: the manifest half-written in place, or
a shard truncated or replaced in place under the same manifest. The server keeps answering from the generation it
read, ``/api/health`` (and ``POST /api/reload``) says ``"status": "degraded"`` with the reason in one line, the log
has one warning per reason however often the index is checked (every 0.2 s here), and once the index is whole again
the status is ``ok`` and the reason is gone. Every request has a timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from vlfit.index.manifest import MANIFEST_NAME
from vlfit.index.store import EmbeddingIndex

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
REQUEST_TIMEOUT = 30
QUERY = {"text": "a red circle", "k": 5}
ENGINE_WARNING = "WARNING - vlfit.serve.engine - "


@pytest.fixture(scope="module")
def server(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory):
    """A server over the synthetic validation split indexed with the tiny checkpoint (exact search), checking the
    index every 0.2 s: ``(url, index folder, log)``. Each test leaves the index whole."""
    import vlfit
    from vlfit.serve.launch import kill_process_tree, start_server

    folder = tmp_path_factory.mktemp("degraded") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(folder), dataset_name=synthetic_dataset_dir, split="validation",
                      index_type="flat")  # fmt: skip
    log = folder.parent / "server.log"
    started = start_server(["--index", str(folder), "--reload_interval", "0.2"], str(log), timeout=START_TIMEOUT,
                           env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        yield started.url, folder, log
    finally:
        kill_process_tree(started.process)


def _results(base: str) -> list[dict]:
    answer = httpx.post(f"{base}/api/search", json=QUERY, timeout=REQUEST_TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


def _health(base: str) -> dict:
    answer = httpx.get(f"{base}/api/health", timeout=REQUEST_TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _health_when(base: str, wanted: Callable[[dict], bool]) -> dict:
    """``/api/health`` once ``wanted`` holds of it (the background check runs every 0.2 s)."""
    deadline = time.monotonic() + 30
    while not wanted(health := _health(base)):
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
    return health


def _engine_warnings(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if ENGINE_WARNING in line]


def test_a_manifest_half_written_in_place_keeps_the_old_generation_and_says_degraded_until_fixed(server) -> None:
    base, folder, log = server
    manifest = folder / MANIFEST_NAME
    whole = manifest.read_bytes()
    before, generation, warned = _results(base), _health(base)["generation"], len(_engine_warnings(log))
    with open(manifest, "r+b") as f:  # half-written in place
        f.truncate(len(whole) // 2)

    for _ in range(4):
        answer = httpx.post(f"{base}/api/reload", timeout=REQUEST_TIMEOUT).json()
        assert answer["reloaded"] is False and answer["generation"] == generation
        assert answer["status"] == "degraded"
    time.sleep(1.0)  # five checks or so of the server's own
    health = _health(base)
    assert health["status"] == "degraded" and health["generation"] == generation
    assert health["reason"].startswith(f"index/{MANIFEST_NAME}: does not parse (JSONDecodeError: "), health
    assert str(folder) not in health["reason"]  # the server's directories stay its own
    assert _results(base) == before
    new = _engine_warnings(log)[warned:]
    assert len(new) == 1, new
    assert f"index {folder} changed but cannot be served ({folder / MANIFEST_NAME}: does not parse (" in new[0]
    assert "rebuild it: vlfit retrieve index" in new[0]

    manifest.write_bytes(whole)  # fixed: read again by this reload or by the server's own check just before it
    answer = httpx.post(f"{base}/api/reload", timeout=REQUEST_TIMEOUT).json()
    assert answer["generation"] == generation + 1, answer
    assert answer["status"] == "ok" and "reason" not in answer
    health = _health(base)
    assert health["status"] == "ok" and "reason" not in health
    assert _results(base) == before
    assert len(_engine_warnings(log)) == warned + 1


def test_a_shard_truncated_or_replaced_in_place_says_degraded_while_the_read_generation_answers(server) -> None:
    base, folder, log = server
    shard = folder / EmbeddingIndex(str(folder)).manifest.shards[0]["embeddings"]
    whole = shard.read_bytes()
    before, generation, warned = _results(base), _health(base)["generation"], len(_engine_warnings(log))

    with open(shard, "r+b") as f:  # cut short where it lies, the manifest unchanged
        f.truncate(len(whole) - 4)
    health = _health_when(base, lambda health: health["status"] == "degraded")
    assert health["reason"] == f"index/{shard.name}: {len(whole) - 4} bytes, the manifest records {len(whole)} " \
                               "(truncated)"  # fmt: skip
    assert health["generation"] == generation and _results(base) == before
    with open(shard, "r+b") as f:  # the size restored, other bytes at the end: replaced in place
        f.write(whole[:-4] + bytes(4))
    health = _health_when(base, lambda health: "checksum" in health.get("reason", ""))
    assert health["reason"].startswith(f"index/{shard.name}: checksum ") and health["reason"].endswith("(changed)")
    assert _results(base) == before
    time.sleep(1.0)  # more checks: no more warnings
    new = _engine_warnings(log)[warned:]
    assert len(new) == 2 and all(f"index {folder} damaged in place ({shard}: " in line for line in new), new

    with open(shard, "r+b") as f:  # restored
        f.write(whole)
    health = _health_when(base, lambda health: health["status"] == "ok")
    assert "reason" not in health and health["generation"] == generation
    assert _results(base) == before
