"""Admission by expected wait (``vlfit.serve.admission``): the estimator fed service times, and the real app (tiny
model, real engine) refusing a search that would wait over its budget with 503 and ``Retry-After``, counted under
``limit="wait"``, while health is answered and a good query is answered once the queue drains."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import vlfit
from tests.serve.test_limits import RecordingEngine, _jpeg
from vlfit.commands.serve import ServeArguments
from vlfit.errors import ConfigError
from vlfit.serve.admission import (
    EWMA_WEIGHT,
    REFERENCE_ANSWERS,
    WAIT_BUDGET_QUERIES,
    WAIT_FLOOR_QUERIES,
    ServiceTime,
    WaitAdmission,
)
from vlfit.serve.app import create_app
from vlfit.serve.limits import ServerLimits


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory) -> RecordingEngine:
    path = tmp_path_factory.mktemp("admission") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation")
    return RecordingEngine(str(path))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_time_per_query_ahead_is_an_ewma_and_the_unloaded_time_the_shortest_with_nothing_ahead() -> None:
    service = ServiceTime()
    assert service.per_query is None and service.alone is None
    service.observe(0, 0.004)  # nothing ahead: the first sample is both estimates
    assert service.per_query == pytest.approx(0.004) and service.alone == pytest.approx(0.004)
    service.observe(7, 0.016)  # 7 ahead, answered in 16 ms: 2 ms per query (a batch of 8)
    assert service.per_query == pytest.approx((1 - EWMA_WEIGHT) * 0.004 + EWMA_WEIGHT * 0.002)
    assert service.alone == pytest.approx(0.004)
    service.observe(-1, 1.0)  # nonsense is ignored
    assert service.per_query == pytest.approx((1 - EWMA_WEIGHT) * 0.004 + EWMA_WEIGHT * 0.002)
    service.observe(0, 0.050)  # alone but slow (an overloaded event loop): the unloaded time stays the shortest
    assert service.alone == pytest.approx(0.004)
    for _ in range(REFERENCE_ANSWERS):  # until the 4 ms answer is out of the window: the machine is slower now
        service.observe(0, 0.006)
    assert service.alone == pytest.approx(0.006)


def test_the_expected_wait_is_the_queries_ahead_times_their_measured_time_each() -> None:
    clock = FakeClock()
    admission = WaitAdmission(budget=0.010, clock=clock)
    assert admission.expected_wait("text") is None  # nothing answered yet: only the count cap applies
    with admission.admitted("text"), admission.admitted("text"), admission.admitted("text"):
        assert admission.pending("text") == 3 and admission.over_budget("text") is None
        with admission.admitted("text"):  # 3 ahead of it, answered 12 ms later: 3 ms per query
            clock.now += 0.012
        assert admission.service_time("text").per_query == pytest.approx(0.003)
        assert admission.expected_wait("text") == pytest.approx(0.009)  # 3 pending x 3 ms
        assert admission.over_budget("text") is None  # 9 ms <= 10 ms
        with admission.admitted("text") as ticket:
            assert admission.over_budget("text") == pytest.approx((0.012, 0.010))  # 4 pending: refuse a fifth
            ticket.answered = False  # its client went away: not timed
            clock.now += 5.0
        assert admission.service_time("text").per_query == pytest.approx(0.003)
        assert admission.expected_wait("image") is None and admission.pending("image") == 0  # a queue of its own
    assert admission.pending("text") == 0 and admission.expected_wait("text") == 0.0  # nothing ahead: admitted


def test_the_default_budget_is_ten_times_a_query_with_nothing_ahead_and_an_idle_server_never_refuses() -> None:
    clock = FakeClock()
    admission = WaitAdmission(clock=clock)
    with admission.admitted("text") as first, admission.admitted("text"):
        clock.now += 0.004  # the second: 1 ahead, 4 ms: 2 ms per query, which stands in for the time alone
        first.answered = False  # (the first failed: untimed)
    assert admission.budget_for("text") == pytest.approx(WAIT_BUDGET_QUERIES * 0.002)
    with admission.admitted("text"):
        clock.now += 0.003  # nothing ahead: the time alone is the reference now
    assert admission.budget_for("text") == pytest.approx(WAIT_BUDGET_QUERIES * 0.003)
    with admission.admitted("text"):
        clock.now += 10.0  # a query alone that took 10 s
    assert admission.over_budget("text") is None  # nothing ahead: admitted
    with pytest.raises(ValueError, match="positive seconds"):
        WaitAdmission(budget=0)


def test_the_wait_budget_flag_is_checked_and_reaches_the_limits() -> None:
    with pytest.raises(ConfigError, match="--max_queue_wait_ms must be at least 0 milliseconds, got -1"):
        ServeArguments(index="x", max_queue_wait_ms=-1)
    assert ServeArguments(index="x").limits().max_queue_wait_ms == 0  # derived from the unloaded time
    assert ServeArguments(index="x", max_queue_wait_ms=25).limits().max_queue_wait_ms == 25


def test_the_app_derives_its_wait_budget_by_default_and_none_turns_it_off(engine) -> None:
    derived = create_app(engine, reload_interval=0).state.admission
    assert derived is not None and derived.budget is None  # 10x the unloaded time of a query of its kind
    off = ServerLimits(max_queue_wait_ms=None)
    assert create_app(engine, reload_interval=0, limits=off).state.admission is None  # --max_concurrency only
    fixed = create_app(engine, reload_interval=0, limits=ServerLimits(max_queue_wait_ms=25)).state.admission
    assert fixed.budget == pytest.approx(0.025)


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


def test_the_derived_budget_admits_a_light_load_and_a_fixed_one_does_not() -> None:
    """Under the derived budget a query with fewer than WAIT_FLOOR_QUERIES of its kind ahead is admitted whatever
    the estimate; at the floor the estimate decides. A fixed budget has no floor."""
    for budget in (None, 0.001):
        clock = FakeClock()
        admission = WaitAdmission(budget=budget, clock=clock)
        with admission.admitted("text"):
            clock.now += 0.001  # alone: 1 ms, so the derived budget is 10 ms
        held = [admission.enter("text") for _ in range(WAIT_FLOOR_QUERIES - 1)]
        clock.now += 1.0
        for ticket in held:
            admission.leave(ticket)  # each answered after 1 s: the time per query ahead is far over any budget
        held = [admission.enter("text") for _ in range(WAIT_FLOOR_QUERIES - 1)]
        refused_below_the_floor = admission.over_budget("text") is not None
        assert refused_below_the_floor == (budget is not None)
        held.append(admission.enter("text"))  # at the floor
        assert admission.over_budget("text") is not None
        for ticket in held:
            admission.leave(ticket)


def test_a_json_base64_image_search_is_timed_and_refused_in_the_image_queue(engine) -> None:
    """A JSON search is admitted from its head as a text; once its body shows a base64 image it waits, is timed and
    is refused as an uploaded image is: in the image queue, not the text one."""
    image = {"image": base64.b64encode(_jpeg(64, 64)).decode(), "k": 1}
    with TestClient(create_app(engine, reload_interval=0)) as client:
        admission = client.app.state.admission
        assert client.post("/api/search", json=image).status_code == 200
        assert admission.service_time("image").per_query is not None  # timed as an image query
        assert admission.service_time("text").per_query is None
        assert admission.pending("text") == admission.pending("image") == 0
        admission.service_time("image").observe(0, 0.5)  # an image query alone took 0.5 s
        tickets = [admission.enter("image") for _ in range(40)]  # 20 s of them ahead; budget 10 x 0.5 s
        try:
            refused = client.post("/api/search", json=image)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "an image query would wait about" in refused.json()["error"]
            assert client.post("/api/search", json={"text": "one red circle", "k": 1}).status_code == 200
        finally:
            for ticket in tickets:
                ticket.answered = False
                admission.leave(ticket)
        assert admission.pending("text") == admission.pending("image") == 0
        assert client.post("/api/search", json=image).status_code == 200
        assert 'vlfit_refused_total{limit="wait"} 1.0' in client.get("/metrics").text
