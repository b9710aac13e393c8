"""The choice rule and the train flags of a configuration; the bench's module layout (a leaf, no cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import vlfit.bench
from tests.bench.bench_runs import row
from vlfit.bench.selection import AUTO_TOLERANCE, best_row, choose, describe, recommend, train_flags

BENCH = Path(vlfit.bench.__file__).parent


def test_choose_prefers_no_preparation_then_fewer_workers_within_the_tolerance() -> None:
    near = 1 - AUTO_TOLERANCE / 2
    rows = [row("fast", 2, 100.0), row("fast", 1, 100.0 * near), row("prepared", 0, 102.0)]
    assert choose(rows)["workers"] == 1 and choose(rows)["pipeline"] == "fast"
    rows.append(row("prepared", 1, 100.0 / (1 - AUTO_TOLERANCE) + 1.0))  # clearly fastest: worth preparing
    assert choose(rows)["pipeline"] == "prepared"
    # Train rows win over loader rows however fast the loader alone is; failed rows are ignored.
    mixed = [row("fast", 2, 900.0, mode="loader"), row("reference", 0, 10.0), row("fast", 1, None)]
    assert choose(mixed)["pipeline"] == "reference"
    assert best_row(mixed)["pipeline"] == "reference"
    assert choose([row("fast", 1, None)]) is None and best_row([row("fast", 1, None)]) is None
    assert choose([row("fast", 2, 100.0, prefetch=4), row("fast", 2, 99.0, prefetch=2)])["prefetch_factor"] == 2


def test_train_flags_reproduce_each_pipeline() -> None:
    device = train_flags(row("device", 2, 1.0, prefetch=4), precision="bf16", batch_size=48)
    assert device == ["--image_pipeline", "fast", "--decode_on_device", "--dataloader_num_workers", "2",
                      "--dataloader_prefetch_factor", "4", "--per_device_train_batch_size", "48", "--bf16"]  # fmt: skip
    reference = train_flags(row("reference", 0, 1.0), precision="fp32", batch_size=8)
    assert reference == ["--image_pipeline", "reference", "--dataloader_num_workers", "0",
                         "--per_device_train_batch_size", "8"]  # fmt: skip
    matched = train_flags(row("fast", 0, 1.0), precision="bf16", batch_size=8, objective="contrastive+itm")
    assert matched[-2:] == ["--objective", "contrastive+itm"]  # the default objective adds no flag (above)
    assert describe(row("fast", 1, 1.0)) == "fast, 1 worker, prefetch 2"
    assert describe(row("fast", 0, 1.0)) == "fast, 0 workers"


def test_recommendation_of_a_prepared_pipeline_prepares_first() -> None:
    settings = {"precision": "bf16", "batch_size": 48, "model_flags": ["--model_preset", "large"]}
    results = {"rows": [row("prepared", 1, 300.0), row("fast", 1, 100.0)], "settings": settings}
    recommendation = recommend(results)
    assert recommendation["prepare_command"].startswith("vlfit prepare --dataset_name DATA --model_preset large")
    assert "--dataset_name prepared/" in recommendation["command"] and "--bf16" in recommendation["command"]
    assert recommend({"rows": [], "settings": {}}) is None


def _bench_imports() -> dict[str, set[str]]:
    graph = {}
    for path in BENCH.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlfit.bench."):
                imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[2] for a in node.names if a.name.startswith("vlfit.bench.")}
        graph[path.stem] = imported
    return graph


def test_bench_modules_import_each_other_without_cycles_and_selection_is_a_leaf() -> None:
    graph = _bench_imports()
    assert graph["selection"] == set() and graph["published"] == set()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for imported in graph[module]:
                visit(imported, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())
