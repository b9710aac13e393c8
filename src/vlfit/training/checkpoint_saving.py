"""The trainer's checkpoint saving: each ``checkpoint-N`` is written into a hidden staging folder and renamed into
place once complete (``vlfit.training.checkpoint_folders``), so a kill during saving never leaves a folder that
resuming (``get_last_checkpoint``) would take for a complete one.

A mixin of ``VlfitTrainer`` (it uses the Trainer's ``args``, ``state`` and ``accelerator``); the trainer adds its
process's part of a checkpoint through ``_save_data_position``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from vlfit.errors import first_line
from vlfit.training.checkpoint_folders import (
    STAGING_PREFIX,
    failed_checkpoint_write,
    publish_staged_checkpoint,
    remove_partial_checkpoints,
)

logger = logging.getLogger(__name__)


class AtomicCheckpointSaving:
    args: Any
    state: Any
    accelerator: Any
    _staging_run_dir: str | None = None  # while a checkpoint is saved: the staging folder the Trainer writes under

    def _save_data_position(self, folder: str) -> None:
        """This process's part of a checkpoint beside the Trainer's, written into ``folder`` (nothing here)."""

    @property
    def _checkpoint_name(self) -> str:
        return f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

    def _get_output_dir(self, trial: Any) -> str:
        # While a checkpoint is being saved, the Trainer writes it under the staging folder.
        return self._staging_run_dir or super()._get_output_dir(trial)  # type: ignore[misc]

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save a checkpoint into a staging folder, then rename it to ``checkpoint-N`` (atomic on one filesystem).

        The checkpoint also holds this process's part (``_save_data_position``). With ``--push_to_hub`` the Trainer
        uploads the folder in the background while training goes on, so it is written in place as the Trainer does.
        """
        if self.args.push_to_hub:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            self._save_data_position(os.path.join(self._get_output_dir(trial), self._checkpoint_name))
            return
        run_dir = self._get_output_dir(trial)
        name = self._checkpoint_name
        final_dir = os.path.join(run_dir, name)
        staging_root = os.path.join(run_dir, STAGING_PREFIX + name)
        staged_dir = os.path.join(staging_root, name)
        if self.args.should_save:
            remove_partial_checkpoints(run_dir)
            os.makedirs(staged_dir)
        self.accelerator.wait_for_everyone()
        self._staging_run_dir = staging_root
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            self._staging_run_dir = None
            os.makedirs(staged_dir, exist_ok=True)
            self._save_data_position(staged_dir)
        except Exception as error:  # a full disk reaches here as ENOSPC, or as torch's zip writer's RuntimeError
            failure = failed_checkpoint_write(error, run_dir, staging_root)
            if failure is None:
                raise
            logger.error("saving %s failed: %s", self._checkpoint_name, first_line(error))
            raise failure from error
        finally:
            self._staging_run_dir = None
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, ledgers, shards)
        if self.args.should_save:
            if self.state.best_model_checkpoint == staged_dir:
                # The Trainer recorded where it just wrote the best checkpoint: record where it will stay instead.
                self.state.best_model_checkpoint = final_dir
                self.state.save_to_json(os.path.join(staged_dir, "trainer_state.json"))
            publish_staged_checkpoint(staged_dir, final_dir)
            # The Trainer rotated inside the staging folder (one checkpoint: nothing to do); rotate for real.
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()
