"""``vlfit serve`` behind nginx (``deploy/nginx/vlfit.conf``): the pressure cases of ``serve_pressure.py`` sent to a
base URL, the front's or vlfit's own, so the two can be compared from the same client.

1. **Idle connections**: 9 and 40 addresses each hold ``FLOOD_EACH`` connections that send nothing and reopen each
   as soon as it is closed, while another address searches one query after another. Figures: its fraction
   answered and its p50, quiet and flooded. Goal: >= 95% answered, p50 within 2x of quiet.
2. **Slow bodies**: 32 and 64 searches from 2 addresses whose bodies arrive a byte a second, while another address
   searches. Figures: what the trickles got (held, refused) and the other's fraction answered. Goal: >= 95%.
3. **One address over its rate**: searches one after another on a kept-open connection for ``RATE_S`` seconds,
   while another address searches at a person's pace. Figures: the first's answers by status, the other's.

``front_pressure(base, texts)`` runs them against a server already up; alone, the script starts ``vlfit serve
--forwarded_allow_ips 127.0.0.1`` on an index and nginx in front of it (Debian's, with a main configuration of
its own under a temporary folder: ``tests/serve/nginx.py``), and prints the figures as JSON:

    python benchmarks/serve_front.py --index DIR [--direct]

``--direct`` sends the same load to vlfit itself instead. About 60 s. Every client has a loopback address of its
own (``127.0.N.M``; Linux routes all of 127/8 to lo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.serve.nginx: nginx, and the clients
from tests.serve import nginx as front  # noqa: E402

FLOODS = (9, 40)  # addresses holding idle connections
FLOOD_EACH = 60
FLOOD_S = 12.0
TRICKLES = (32, 64)  # bodies trickled, from 2 addresses
QUERIES = 40
PAUSE = 0.12  # between one client's queries: a person's pace, under the front's 10 searches a second
RATE_S = 5.0


def _figures(tally: front.Tally) -> dict:
    return {"statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
            "answered": round(tally.answered(), 3), "p50_ms": tally.p50_ms() if tally.seconds else None}  # fmt: skip


def _idle(base: str, texts: list[str], addresses: int) -> dict:
    quiet = asyncio.run(front.queries(base, "127.0.3.1", texts, QUERIES, PAUSE))
    with front.Flood(base, [f"127.0.2.{n + 1}" for n in range(addresses)], FLOOD_EACH, FLOOD_S) as flood:
        time.sleep(3.0)  # the flood's process started and holds what it can
        flooded = asyncio.run(front.queries(base, "127.0.3.2", texts, QUERIES, PAUSE))
    return {"addresses": addresses, "connections_each": FLOOD_EACH, "quiet": _figures(quiet),
            "flooded": _figures(flooded), "p50_ratio": round(flooded.p50_ms() / quiet.p50_ms(), 2),
            "closed_by_server": flood.closed_by_server}  # fmt: skip


async def _slow_bodies(base: str, texts: list[str], count: int) -> dict:
    stop, outcomes, refusals = asyncio.Event(), Counter(), []
    trickles = [asyncio.ensure_future(front.trickle(base, f"127.0.4.{1 + n % 2}", stop, outcomes, refusals))
                for n in range(count)]  # fmt: skip
    try:
        await asyncio.sleep(2.0)
        others = await front.queries(base, "127.0.4.3", texts, QUERIES, PAUSE)
    finally:
        stop.set()
        await asyncio.gather(*trickles)
    return {"trickles": count, "outcomes": {str(k): v for k, v in outcomes.items()}, "others": _figures(others)}


async def _over_rate(base: str, texts: list[str]) -> dict:
    over, other = await asyncio.gather(front.back_to_back(base, "127.0.5.1", texts, RATE_S),
                                       front.queries(base, "127.0.5.2", texts, int(RATE_S / PAUSE), PAUSE))  # fmt: skip
    return {"seconds": RATE_S, "over_rate": _figures(over), "other": _figures(other)}


def front_pressure(base: str, texts: list[str]) -> dict:
    """The three cases against the server at ``base`` (``https://127.0.0.1:PORT`` of the front, or vlfit's own
    ``http(s)://127.0.0.1:PORT``), with ``texts`` as the searches' queries."""
    return {"idle": [_idle(base, texts, addresses) for addresses in FLOODS],
            "slow_bodies": [asyncio.run(_slow_bodies(base, texts, count)) for count in TRICKLES],
            "over_rate": asyncio.run(_over_rate(base, texts))}  # fmt: skip


def main() -> int:
    from vlfit.serve.launch import kill_process_tree, start_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True)
    parser.add_argument("--direct", action="store_true", help="load vlfit serve itself, not the front")
    args = parser.parse_args()
    nginx = front.find_nginx()
    if nginx is None:
        print("serve_front: needs Debian's nginx (scripts/system-packages.sh installs it)", file=sys.stderr)
        return 2
    texts = [f"a photo number {n}" for n in range(64)]
    with tempfile.TemporaryDirectory() as folder:
        server = start_server(["--index", args.index, "--reload_interval", "0", "--forwarded_allow_ips", "127.0.0.1"],
                              os.path.join(folder, "server.log"), env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
        proxy = None
        try:
            proxy = front.start_nginx(nginx, Path(folder) / "nginx", f"127.0.0.1:{server.port}", worker_connections=768)
            base = server.url if args.direct else proxy.url
            print(json.dumps({"base": "vlfit" if args.direct else "nginx front", **front_pressure(base, texts)},
                             indent=1))  # fmt: skip
        finally:
            if proxy is not None:
                front.stop_nginx(proxy.process)
            kill_process_tree(server.process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
