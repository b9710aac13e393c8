"""Helpers to run ``vlfit search`` on the tiny preset: its flags, a space file, and the study read back from its
storage."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

STUDY = "vlfit-search"
# Wide ranges, so that trials differ; learning_rate on a log scale; a training flag and a model flag.
SPACE = {
    "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
    "warmup_steps": {"type": "float", "low": 0.0, "high": 0.2},
    "logit_scale_init_value": {"type": "float", "low": 1.6, "high": 4.6},
}


def write_space(folder: Path, space: dict | None = None) -> Path:
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space or SPACE))
    return path


def search_argv(data: str, output_dir: Path | str, space: Path | str, *extra: str, steps: int = 4) -> list[str]:
    """``vlfit search`` flags for a short study of CPU trials on the tiny preset, evaluating every 2 steps."""
    return [
        "--model_preset", "tiny", "--dataset_name", data, "--output_dir", str(output_dir), "--report_to", "none",
        "--max_steps", str(steps), "--per_device_train_batch_size", "8", "--logging_steps", "1",
        "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "no",
        "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--seed", "11",
        "--search_space", str(space), *extra,
    ]  # fmt: skip


def load_trials(output_dir: Path | str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, from the SQLite file in ``output_dir``."""
    storage = f"sqlite:///{Path(output_dir).resolve() / 'search.db'}"
    return optuna.load_study(study_name=STUDY, storage=storage).get_trials()
