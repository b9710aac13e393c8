"""Re-ranking latency in ``vlfit serve``: text queries one at a time against a real server process, without
re-ranking and with ``"rerank": K`` (K = 10, 50), on the INT8 export of a BridgeTower model with an image-text
matching head (its ``itm.int8.onnx`` re-scores the candidates; no torch in the request path).

The model is a random-init preset with a new matching head (a query costs the same whatever the weights), exported
with ``vlfit export --quantize int8``; the index holds the train split of ``vlfit make-data``'s synthetic scenes.

    python benchmarks/serve_rerank.py --preset small-p8 --samples 400 --queries 30 --results benchmarks/results/x.json

Prints one JSON object: per level, the client-side latency p50/p90 in ms, the server's ``took_ms`` p50, and what
each stage took on the server (``stages``: encode, search and rerank, their medians and means from the
``vlfit_stage_seconds`` histogram of ``/metrics``, read before and after the level).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.inference.tiny_models: the random-init presets

from tests.inference.tiny_models import save_itm_checkpoint, save_tiny_checkpoint  # noqa: E402

from vlfit.serve.launch import kill_process_tree, start_server  # noqa: E402
from vlfit.serve.metrics import stage_figures  # noqa: E402

TEXTS = ["a red circle", "two blue squares", "a green triangle at the top", "three yellow circles on the left",
         "a purple square and a red triangle", "one small orange circle"]  # fmt: skip


def _vlfit(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "vlfit", *argv], check=True, stdout=subprocess.DEVNULL)


def _search(port: int, body: dict) -> tuple[float, float]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/search", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as answer:
        took = json.load(answer)["took_ms"]
    return 1000 * (time.perf_counter() - started), took


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def measure(port: int, rerank: int | None, queries: int, k: int = 10) -> dict:
    body = {"k": k, **({"rerank": rerank} if rerank else {})}
    for text in TEXTS[:3]:  # warm-up: first calls allocate
        _search(port, {**body, "text": text})
    before = _metrics(port)
    client, server = [], []
    for i in range(queries):
        latency, took = _search(port, {**body, "text": TEXTS[i % len(TEXTS)]})
        client.append(latency)
        server.append(took)
    deciles = statistics.quantiles(client, n=10)
    return {"rerank": rerank, "queries": queries, "p50_ms": round(statistics.median(client), 2),
            "p90_ms": round(deciles[8], 2), "server_p50_ms": round(statistics.median(server), 2),
            "stages": stage_figures(_metrics(port), since=before)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small-p8")
    parser.add_argument("--samples", type=int, default=400, help="Synthetic samples (the index holds the train split).")
    parser.add_argument("--queries", type=int, default=30, help="Queries per level.")
    parser.add_argument("--out", default="runs/serve-rerank")
    parser.add_argument("--results", default=None, help="Also write the JSON here.")
    args = parser.parse_args()

    out = Path(args.out)
    data, checkpoint, export, index = out / "data", out / "checkpoint", out / "export", out / "index"
    if not data.exists():
        _vlfit("make-data", "--output_dir", str(data), "--num_samples", str(args.samples), "--seed", "0")
    if not export.exists():
        plain = save_tiny_checkpoint(str(data), out / "plain", preset=args.preset)
        save_itm_checkpoint(plain, checkpoint)
        _vlfit("export", "--model_name_or_path", str(checkpoint), "--output_dir", str(export), "--quantize", "int8",
               "--calibration_dataset", str(data), "--parity_samples", "16", "--calibration_samples", "16")  # fmt: skip
    if not index.exists():
        _vlfit("retrieve", "index", "--model", str(export), "--dataset_name", str(data), "--split", "train",
               "--output_dir", str(index), "--disable_tqdm", "--dataloader_num_workers", "1")  # fmt: skip
    server = start_server(["--index", str(index)], str(out / "serve.log"))
    port = server.port
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=10) as answer:
            health = json.load(answer)
        assert health["rerank"], health
        levels = [measure(port, rerank, args.queries) for rerank in (None, 10, 50)]
    finally:
        kill_process_tree(server.process)
    result = {"preset": args.preset, "items": health["items"], "model": health["model"], "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "levels": levels}  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if args.results:
        Path(args.results).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
