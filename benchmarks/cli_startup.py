"""CPU seconds (user + sys) from start to the answer for what a newcomer types first: a mistyped flag, a value of
the wrong type or out of its range, a rule between flags, a missing data file, a missing ``--index`` folder, a folder
of images given as the model, a missing run, a folder of the user's own files as ``--output_dir`` and ``--help``,
answered from the recorded flag index (before the heavy imports) and by the command's own parser (after them), each
in a fresh process, median of N runs.

    python benchmarks/cli_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

CASES = {
    "typo (train --learning_rat 1e-3)": ["train", "--learning_rat", "1e-3"],
    "type (train --learning_rate abc)": ["train", "--learning_rate", "abc"],
    "choice (train --lr_scheduler_type x)": ["train", "--lr_scheduler_type", "x"],
    "rule (train sampling + one_per_image)": [
        "train",
        "--model_preset",
        "tiny",
        "--train_sampling_strategy",
        "group_by_length",
        "--caption_sampling",
        "one_per_image",
        "--output_dir",
        "out",
    ],  # fmt: skip
    "missing --train_file": ["train", "--model_preset", "tiny", "--train_file", "missing.csv", "--output_dir", "out"],
    "missing --index (retrieve query)": ["retrieve", "query", "--index", "missing", "--text", "a cat"],
    "range (train --max_num_patches 100000)": [
        "train",
        "--model_preset",
        "siglip2-tiny",
        "--max_num_patches",
        "100000",
        "--output_dir",
        "out",
    ],
    "range (eval --max_seq_length 0)": ["eval", "--model_preset", "tiny", "--max_seq_length", "0"],
    "rule (eval --task vqa --rerank_top_k)": ["eval", "--model_preset", "tiny", "--task", "vqa", "--rerank_top_k", "5"],
    "images as the model (eval)": ["eval", "--model_name_or_path", "photos"],
    "missing run (merge --runs)": ["merge", "--method", "uniform", "--runs", "runs/a", "runs/b", "--output_dir", "m"],
    "user's folder (make-data --output_dir)": ["make-data", "--output_dir", "mine"],
    "train --help": ["train", "--help"],
    "import vlfit": None,
}
RUN = "import sys; from vlfit.cli import main; sys.exit(main(sys.argv[2:], answer_from_index=sys.argv[1] == '1'))"


def cpu_seconds(argv: list[str] | None, from_index: bool, cwd: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = (
        [sys.executable, "-c", "import vlfit"]
        if argv is None
        else [sys.executable, "-c", RUN, "1" if from_index else "0", *argv]
    )
    subprocess.run(command, capture_output=True, cwd=cwd, timeout=300, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _make_folders(cwd: str) -> None:
    """What the cases name: a folder of images (``photos``), one of the user's own files (``mine``) and ``runs``."""
    from PIL import Image

    for name in ("photos", "mine", "runs"):
        os.makedirs(os.path.join(cwd, name))
    Image.new("RGB", (8, 8)).save(os.path.join(cwd, "photos", "a.png"))
    with open(os.path.join(cwd, "mine", "notes.csv"), "w") as f:
        f.write("image,caption\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cwd:
        _make_folders(cwd)
        for name, argv in CASES.items():
            row = {}
            for from_index in (True, False):
                times = [cpu_seconds(argv, from_index, cwd) for _ in range(args.runs)]
                row["flag index" if from_index else "parser"] = round(statistics.median(times), 3)
                if argv is None:
                    break
            results[name] = row
            print(f"{name:<36} " + "  ".join(f"{k}: {v:.3f} s CPU" for k, v in row.items()), flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
