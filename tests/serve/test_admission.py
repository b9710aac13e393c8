"""Admission by expected wait (``vlfit.serve.admission``): the estimator fed service times, and the real app (tiny
model, real engine) refusing a search that would wait over its budget with 503 and ``Retry-After``, counted under
``limit="wait"``, while health is answered and a good query is answered once the queue drains."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

import vlfit
from tests.serve.test_limits import RecordingEngine, _jpeg
from vlfit.commands.serve import ServeArguments
from vlfit.errors import ConfigError
from vlfit.serve.admission import EWMA_WEIGHT, WAIT_BUDGET_QUERIES, ServiceTime, WaitAdmission
from vlfit.serve.app import create_app
from vlfit.serve.limits import ServerLimits


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory) -> RecordingEngine:
    path = tmp_path_factory.mktemp("admission") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation")
    return RecordingEngine(str(path))


def test_the_service_time_is_an_ewma_per_query_and_of_queries_computed_alone() -> None:
    time = ServiceTime()
    assert time.per_query is None and time.alone is None
    time.observe(1, 0.004)  # the first sample is the estimate
    assert time.per_query == pytest.approx(0.004) and time.alone == pytest.approx(0.004)
    time.observe(8, 0.016)  # 2 ms per query in a batch of 8; not a query alone
    assert time.per_query == pytest.approx((1 - EWMA_WEIGHT) * 0.004 + EWMA_WEIGHT * 0.002)
    assert time.alone == pytest.approx(0.004)
    time.observe(0, 1.0)  # an empty batch says nothing
    assert time.per_query == pytest.approx((1 - EWMA_WEIGHT) * 0.004 + EWMA_WEIGHT * 0.002)


def test_the_expected_wait_is_the_queries_ahead_times_the_recent_time_per_query() -> None:
    admission = WaitAdmission(budget=0.010)
    assert admission.expected_wait("text") is None  # no timing yet: only the count cap applies
    with admission.admitted("text"), admission.admitted("text"), admission.admitted("text"):
        assert admission.pending("text") == 3 and admission.over_budget("text") is None
        admission.observe("text", 4, 0.012)  # 3 ms per query
        assert admission.expected_wait("text") == pytest.approx(0.009)
        assert admission.over_budget("text") is None  # 9 ms <= 10 ms
        with admission.admitted("text"):
            assert admission.over_budget("text") == pytest.approx((0.012, 0.010))
        assert admission.expected_wait("image") is None and admission.pending("image") == 0  # a queue of its own
    assert admission.pending("text") == 0 and admission.expected_wait("text") == 0.0


def test_the_default_budget_is_ten_times_a_query_computed_alone_and_an_idle_server_never_refuses() -> None:
    admission = WaitAdmission()
    admission.observe("text", 8, 0.016)  # batches only: 2 ms per query stands in for the lone time
    assert admission.budget_for("text") == pytest.approx(WAIT_BUDGET_QUERIES * 0.002)
    admission.observe("text", 1, 0.003)  # the first query computed alone: its time is the reference now
    assert admission.budget_for("text") == pytest.approx(WAIT_BUDGET_QUERIES * 0.003)
    admission.observe("text", 1, 10.0)  # a query alone that took 10 s: nothing ahead, still admitted
    assert admission.over_budget("text") is None
    workers = WaitAdmission(budget=0.005, workers={"image": 2})
    workers.observe("image", 1, 0.004)
    with workers.admitted("image"), workers.admitted("image"):
        assert workers.expected_wait("image") == pytest.approx(0.004)  # two queries ahead, two threads
    with pytest.raises(ValueError, match="positive seconds"):
        WaitAdmission(budget=0)


def test_the_wait_budget_flag_is_checked_and_reaches_the_limits() -> None:
    with pytest.raises(ConfigError, match="--max_queue_wait_ms must be positive milliseconds, got 0"):
        ServeArguments(index="x", max_queue_wait_ms=0)
    assert ServeArguments(index="x").limits().max_queue_wait_ms is None
    assert ServeArguments(index="x", max_queue_wait_ms=25).limits().max_queue_wait_ms == 25


def test_a_search_over_its_wait_budget_gets_503_while_health_and_other_kinds_are_answered(engine) -> None:
    async def run() -> dict[str, object]:
        app = create_app(engine, reload_interval=0, limits=ServerLimits(max_queue_wait_ms=0.001))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                first = await http.post("/api/search", json={"text": "one red circle", "k": 1})  # timed: a sample
                engine.hold.clear()  # the encoder is busy: the next query stays in flight
                try:
                    slow = asyncio.ensure_future(http.post("/api/search", json={"text": "a slow query", "k": 1}))
                    for _ in range(200):  # until the slow query is admitted and pending
                        await asyncio.sleep(0.01)
                        if app.state.admission.pending("text") == 1:
                            break
                    refused = await http.post("/api/search", json={"text": "one query too many", "k": 1})
                    health = await http.get("/api/health")
                    image = await http.post("/api/search", files={"file": ("q.jpg", _jpeg(64, 64), "image/jpeg")},
                                            data={"k": "1"})  # fmt: skip
                finally:
                    engine.hold.set()
                answered = await slow
                after = await http.post("/api/search", json={"text": "two blue squares", "k": 2})
                metrics = (await http.get("/metrics")).text
        return {"first": first, "refused": refused, "health": health, "image": image, "slow": answered,
                "after": after, "metrics": metrics}  # fmt: skip

    got = asyncio.run(run())
    refused = got["refused"]
    assert got["first"].status_code == 200 and got["slow"].status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "a text query would wait about" in refused.json()["error"]
    assert "over the budget of 0.001 ms (--max_queue_wait_ms)" in refused.json()["error"]
    assert "one query too many" not in engine.embedded  # refused before it was queued
    assert got["health"].status_code == 200  # never refused: a monitor sees the server up
    assert got["image"].status_code == 200  # images wait in a queue of their own, not behind the texts
    assert got["after"].status_code == 200 and len(got["after"].json()["results"]) == 2
    assert 'vlfit_refused_total{limit="wait"} 1.0' in got["metrics"]
    assert 'vlfit_refused_total{limit="requests"}' not in got["metrics"]
