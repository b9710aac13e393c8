"""Debian's nginx with ``deploy/nginx/vlfit.conf`` in front of a real ``vlfit serve --forwarded_allow_ips
127.0.0.1``, over TLS on a free loopback port: the pressure a few clients put on the front leaves the others
answered. Every client has a loopback address of its own (``127.0.0.N``), so nginx's per-address limits see them as
the distinct clients they stand for.

1. A flood of idle connections from a few addresses, each reopened as soon as nginx closes it, past nginx's
   ``worker_connections``: another address's searches are answered (nginx closes idle connections first).
2. Bodies trickled a byte a second: each address gets ``limit_conn`` of them, the rest 429 with Retry-After; vlfit
   sees none of them, and another address's searches are answered.
3. One address far over ``limit_req``'s rate gets 429 with Retry-After from nginx; another address is answered.
4. vlfit's per-client limit (``--max_concurrency_per_client 1`` here) applies to the address nginx forwards: eight
   clients at once are never refused for sharing nginx's address, one client's eight at once are.

Skipped without Debian's nginx (failed under ``CI=true``: ``tests.serve.nginx``). Each case is bounded by counts
and timeouts; the four take about 25 s after their fixtures. Before them, without a process: the shipped file's
placeholders are all filled and ``nginx -t`` accepts it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.serve.nginx import (
    ANSWER_TIMEOUT,
    SEARCH,
    Answer,
    Flood,
    Tally,
    ask,
    back_to_back,
    nginx_command,
    nginx_verdict,
    queries,
    render,
    require_nginx,
    search_request,
    start_nginx,
    stop_nginx,
    trickle,
)

START_TIMEOUT = 120  # seconds for vlfit serve to load the model and bind, far above what it takes
WORKER_CONNECTIONS = 256  # nginx's pool in this test (Debian's nginx.conf: 768), run out by the flood
FLOOD = (["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"], 100)  # addresses, idle connections each
TRICKLES = (["127.0.0.20", "127.0.0.21"], 24)  # addresses, bodies trickled from each
LIMIT_CONN = 16  # deploy/nginx/vlfit.conf's limit_conn per address
LIMIT_REQ_BURST = 20  # and its limit_req burst for searches, at 10 a second
QUERIES = 30
PAUSE = 0.12  # between one client's queries: under limit_req's 10 a second
NGINX_DETAIL = b"too many requests from this address at the proxy"  # deploy/nginx/vlfit.conf's @too_many


@pytest.fixture(scope="module")
def front(served_index: Path, tmp_path_factory):
    """(vlfit serve's URL, its log, the nginx in front of it)."""
    from vlfit.serve.launch import kill_process_tree, start_server

    nginx = require_nginx()
    folder = tmp_path_factory.mktemp("front")
    flags = ["--index", str(served_index), "--reload_interval", "0", "--forwarded_allow_ips", "127.0.0.1",
             "--max_concurrency_per_client", "1"]  # fmt: skip
    server = start_server(flags, str(folder / "server.log"), timeout=START_TIMEOUT,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    proxy = None
    try:
        proxy = start_nginx(nginx, folder / "nginx", f"127.0.0.1:{server.port}", worker_connections=WORKER_CONNECTIONS)
        yield server.url, folder / "server.log", proxy
    finally:
        if proxy is not None:
            stop_nginx(proxy.process)
        kill_process_tree(server.process)


@pytest.fixture(scope="module")
def texts(train_records) -> list[str]:
    return [record.caption for record in train_records]


def _searches_answered(vlfit: str) -> float:
    """The searches vlfit itself answered 200 (from its /metrics, asked directly)."""
    text = httpx.get(f"{vlfit}/metrics", timeout=ANSWER_TIMEOUT).text
    found = re.search(rf'^vlfit_requests_total{{route="{SEARCH}",status="200"}} (\S+)$', text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def _is_nginx_refusal(answer: Answer) -> bool:
    return answer.status == 429 and answer.headers.get(b"retry-after") == b"1" and NGINX_DETAIL in answer.body


def test_a_missing_nginx_fails_under_ci_and_is_skipped_with_the_reason_elsewhere() -> None:
    verdict, reason = nginx_verdict(None, ci=True)
    assert verdict == "fail" and "Debian's nginx, not installed" in reason and "CI=true" in reason
    verdict, reason = nginx_verdict(None, ci=False)
    assert verdict == "skip" and "scripts/system-packages.sh" in reason
    assert nginx_verdict("/usr/sbin/nginx", ci=True) == ("run", "")


def test_the_shipped_configuration_fills_every_placeholder_and_nginx_accepts_it(tmp_path) -> None:
    assert (
        render("a ${VLFIT_LISTEN} $remote_addr ${VLFIT_LISTEN};", {"VLFIT_LISTEN": "443"}) == "a 443 $remote_addr 443;"
    )
    with pytest.raises(KeyError, match="VLFIT_NOT_GIVEN"):
        render("${VLFIT_NOT_GIVEN}", {})
    command = nginx_command(require_nginx(), tmp_path, 8443, "127.0.0.1:8000")
    assert "${" not in (tmp_path / "vlfit.conf").read_text()
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr + (tmp_path / "error.log").read_text()


@pytest.mark.slow
def test_idle_connections_from_a_few_addresses_leave_another_answered(front, texts) -> None:
    _, _, proxy = front
    quiet = asyncio.run(queries(proxy.url, "127.0.0.8", texts, 20, PAUSE))
    with Flood(proxy.url, *FLOOD, seconds=8.0) as flood:
        time.sleep(2.0)  # the flood's process started and filled the pool
        flooded = asyncio.run(queries(proxy.url, "127.0.0.9", texts, QUERIES, PAUSE))
    print(f"flood: quiet p50 {quiet.p50_ms()} ms; under {len(FLOOD[0])}x{FLOOD[1]} idle connections "
          f"{dict(flooded.statuses)} p50 {flooded.p50_ms()} ms; {flood.closed_by_server} closed by nginx")  # fmt: skip
    assert quiet.answered() == 1.0, quiet.statuses
    # The flood ran nginx out of connections (it says so, and closed idle ones to make room), and still:
    assert "worker_connections are not enough" in proxy.error_log
    assert flood.closed_by_server > 0
    assert flooded.answered() >= 0.95, (flooded.statuses, flooded.refusals[:3])
    assert flooded.p50_ms() < 1000, (quiet.p50_ms(), flooded.p50_ms())  # answered at once, not after a timeout


@pytest.mark.slow
def test_trickled_bodies_are_held_by_nginx_per_address_and_others_are_answered(front, texts) -> None:
    vlfit, _, proxy = front
    before = _searches_answered(vlfit)

    async def run() -> tuple[Tally, Counter, list[Answer]]:
        stop, outcomes, refusals = asyncio.Event(), Counter(), []
        addresses, each = TRICKLES
        trickles = [asyncio.ensure_future(trickle(proxy.url, address, stop, outcomes, refusals))
                    for address in addresses for _ in range(each)]  # fmt: skip
        try:
            await asyncio.sleep(1.5)  # every head sent, the refusals among them answered
            others = await queries(proxy.url, "127.0.0.22", texts, QUERIES, PAUSE)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*trickles), ANSWER_TIMEOUT)
        return others, outcomes, refusals

    others, outcomes, refusals = asyncio.run(run())
    print(f"slow bodies: {dict(outcomes)}; others {dict(others.statuses)} p50 {others.p50_ms()} ms")
    addresses, each = TRICKLES
    # limit_conn: each address keeps 16 bodies arriving, the rest are refused at once with Retry-After ...
    assert outcomes == {"still_sending": LIMIT_CONN * len(addresses), 429: (each - LIMIT_CONN) * len(addresses)}
    assert all(_is_nginx_refusal(answer) for answer in refusals), refusals[:2]
    # ... vlfit never saw a trickled body (it answered exactly the other client's searches), and they were answered.
    assert _searches_answered(vlfit) - before == others.statuses[200]
    assert others.answered() >= 0.95, (others.statuses, others.refusals[:3])


@pytest.mark.slow
def test_an_address_over_its_request_rate_gets_429_while_another_is_answered(front, texts) -> None:
    _, _, proxy = front

    async def run():
        started = time.monotonic()
        over = await back_to_back(proxy.url, "127.0.0.30", texts, 3.0)
        return over, time.monotonic() - started

    async def both():
        return await asyncio.gather(run(), queries(proxy.url, "127.0.0.31", texts, 20, PAUSE))

    (over, seconds), other = asyncio.run(both())
    print(f"rate: one address {dict(over.statuses)} in {seconds:.1f} s; another {dict(other.statuses)} "
          f"p50 {other.p50_ms()} ms")  # fmt: skip
    # The burst and then 10 a second pass; the rest are nginx's 429 with Retry-After, at once.
    assert set(over.statuses) == {200, 429}, over.statuses
    assert LIMIT_REQ_BURST < over.statuses[200] <= LIMIT_REQ_BURST + 1 + 10 * seconds + 1, over.statuses
    assert over.statuses[429] > over.statuses[200], over.statuses
    assert all(_is_nginx_refusal(answer) for answer in over.refusals), over.refusals[:2]
    assert other.answered() == 1.0, (other.statuses, other.refusals[:3])


@pytest.mark.slow
def test_vlfit_limits_each_client_by_the_address_nginx_forwards(front, texts) -> None:
    _, log, proxy = front
    addresses = [f"127.0.0.{40 + n}" for n in range(8)]

    async def at_once(address: str) -> list[Answer | None]:
        asked = await asyncio.gather(*(ask(proxy.url, address, search_request(text)) for text in texts[:8]))
        return [answer for answer, _ in asked]

    async def run():
        # Eight clients, one search in flight each: with --max_concurrency_per_client 1 they would refuse each
        # other if vlfit saw them all as nginx's 127.0.0.1.
        tallies = await asyncio.gather(*(queries(proxy.url, address, texts, 16, 0.05) for address in addresses))
        rounds = []
        for _ in range(4):  # one client's eight at once: over its one, refused by vlfit (not nginx)
            rounds.append(await at_once("127.0.0.50"))
            if any(answer and answer.status == 429 and not _is_nginx_refusal(answer) for answer in rounds[-1]):
                break
            await asyncio.sleep(0.5)
        return tallies, rounds

    tallies, rounds = asyncio.run(run())
    statuses = sum((tally.statuses for tally in tallies), Counter())
    print(
        f"per client: eight clients {dict(statuses)}; one client's eight at once, by round: "
        f"{[dict(Counter(answer.status if answer else 'failed' for answer in round_)) for round_ in rounds]}"
    )
    assert statuses == {200: 16 * len(addresses)}, [tally.refusals[:1] for tally in tallies]
    answers = [answer for round_ in rounds for answer in round_ if answer is not None]
    refused = [answer for answer in answers if answer.status == 429 and not _is_nginx_refusal(answer)]
    per_client = (b"--max_concurrency_per_client", b"--max_uploads_per_client")  # vlfit's shares of one client
    assert refused and all(any(flag in answer.body for flag in per_client) for answer in refused), answers[:3]
    assert any(answer.status == 200 for answer in answers)
    # vlfit's own access log names each client, not nginx (uvicorn reads the same header it trusts). Its lines are
    # written by a thread of their own (vlfit.logs.BackgroundAccessLog), a moment after each answer: waited for.
    wanted = [f'{address}:0 - "POST {SEARCH} HTTP/1.1" 200' for address in [*addresses, "127.0.0.50"]]
    deadline = time.monotonic() + 10
    while not all(line in (logged := log.read_text()) for line in wanted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(line in logged for line in wanted)
    assert f'127.0.0.1:0 - "POST {SEARCH}' not in logged
