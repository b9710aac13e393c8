"""``LeanStep``: the parts of the Trainer's step that walk every module or parameter at each step, done once.

A mixin of ``VlfitTrainer``. Each part takes the Trainer's own code wherever anything else is in play (DeepSpeed,
FSDP, a gradient scaler, context parallelism, LOMO optimizers, several devices in one process); measured on the
tiny preset at batch 16 on 2 AMX cores, where the step is short enough for its fixed costs to show
(``benchmarks/trainer_overhead.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache
from transformers.training_args import OptimizerNames
from transformers.utils import is_sagemaker_mp_enabled

from vlfit.data.batch import Batch
from vlfit.models.family import LossScope
from vlfit.training.gradient_cache import gradient_cached_backward
from vlfit.training.master_weights import MasterWeights

# Where every gradient is a plain tensor of this process's whole model: one process, or DDP (after its all-reduce).
PLAIN_GRADIENTS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
LOMO_OPTIMIZERS = (OptimizerNames.LOMO, OptimizerNames.ADALOMO)  # their step takes the learning rate (the Trainer's)


class LeanStep:
    """The step, its FLOP count and its gradient clipping (see the module docstring)."""

    _counted_parameters: tuple[torch.nn.Module, int] | None = None  # floating_point_ops
    _listed_parameters: tuple[torch.nn.Module, list[torch.nn.Parameter]] | None = None  # clipping, zero_grad
    master_weights: MasterWeights | None = None  # --bf16_weights, while training (the trainer sets it)

    @property
    def _gradient_cache_chunk_size(self) -> int:
        return int(getattr(self.args, "gradient_cache_chunk_size", None) or 0)

    @property
    def _step_is_plain(self) -> bool:
        """Whether the Trainer's step would do nothing but the forward and backward of ``_own_step``: no DeepSpeed,
        FSDP, SageMaker or context parallelism, no LOMO optimizer, one device per process."""
        args = self.args
        return (
            self.accelerator.distributed_type in PLAIN_GRADIENTS
            and args.n_gpu <= 1
            and getattr(args, "parallelism_config", None) is None
            and not is_sagemaker_mp_enabled()
            and args.optim not in LOMO_OPTIMIZERS
            and self.loss_is_scaled_for_ga is None
            and self.compute_loss_func is None
        )

    def _own_step(self, model: torch.nn.Module, inputs: Batch) -> torch.Tensor:
        """The Trainer's ``training_step`` where the step is plain (``_step_is_plain``), or gradient-cached
        (``--gradient_cache_chunk_size``, ``vlfit.training.gradient_cache``, for a batch with rows).

        The model is put in training mode only where it (or the model a wrapper of it holds) is not: ``train()``
        walks every module (0.39 ms of a 30 ms step of the tiny preset on one thread), and vlfit's evaluations give
        the model back in the mode they found.
        """
        if not (model.training and self.model.training):
            model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimizers, as the Trainer's step does
            self.optimizer.train()
        batch = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            if self._gradient_cache_chunk_size and len(batch):  # a batch without rows: the plain loss
                return gradient_cached_backward(
                    self.family,
                    model,
                    batch.inputs,
                    self._gradient_cache_chunk_size,
                    scope=LossScope.of(self.args),
                    backward=self.accelerator.backward,
                    no_sync=lambda: self.accelerator.no_sync(model),
                    device=self.args.device,
                )
            loss = self.compute_loss(model, batch)
        del batch
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            clear_device_cache()
        loss = loss / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()

    def _run_epoch(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The Trainer's loop calls model.zero_grad() after every optimizer step, which walks every module for
        # parameters() (0.76 ms of a 36 ms step of the tiny preset on one thread, where the optimizer's zero_grad
        # over its list takes 0.21 ms): for the epoch, the model's zero_grad sets the gradients of its parameters,
        # listed once, to None, as nn.Module's does.
        plain_zero_grad = type(model).zero_grad is torch.nn.Module.zero_grad and "zero_grad" not in vars(model)
        if not (model is self.model and plain_zero_grad and self._step_is_plain):
            return super()._run_epoch(model, *args, **kwargs)  # type: ignore[misc]
        model.zero_grad = ListedZeroGrad(model, self._parameters_of(model))  # type: ignore[method-assign]
        try:
            return super()._run_epoch(model, *args, **kwargs)  # type: ignore[misc]
        finally:
            del model.zero_grad

    def floating_point_ops(self, inputs: Any) -> int:
        # The Trainer's count for total_flos (6 x the main input's elements x the parameters outside embeddings),
        # with the parameters counted once per model: counting walks every module and parameter, which the Trainer
        # did at every step (about 3 ms of a 50 ms step of the tiny preset on 2 CPU cores).
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._counted_parameters is None or self._counted_parameters[0] is not self.model:
            self._counted_parameters = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._counted_parameters[1]

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None and self.master_weights is not None:  # --max_grad_norm 0
            return torch.nn.utils.clip_grad_norm_(self.master_weights.trained, float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        if self.master_weights is not None:  # --bf16_weights: the gradients are in the fp32 copies
            return torch.nn.utils.clip_grad_norm_(self.master_weights.trained, self.args.max_grad_norm)
        # Where gradients are plain tensors and unscaled, accelerate's clip_grad_norm_ is torch's, after a walk of
        # every module for model.parameters() and a DTensor check of every gradient in Python at each step (1.18
        # against 0.80 ms for the tiny preset's fresh gradients on 2 AMX cores): the parameters are listed once.
        plain = self.accelerator.distributed_type in PLAIN_GRADIENTS and self.accelerator.scaler is None
        if not plain or self._has_mixed_mesh_grads(model):
            return super()._clip_grad_norm(model)
        return torch.nn.utils.clip_grad_norm_(self._parameters_of(model), self.args.max_grad_norm)

    def _parameters_of(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """``model.parameters()``, listed once per model (each listing walks every module)."""
        if self._listed_parameters is None or self._listed_parameters[0] is not model:
            self._listed_parameters = (model, list(model.parameters()))
        return self._listed_parameters[1]


class ListedZeroGrad:
    """``model.zero_grad`` over ``parameters``, ``model``'s listed once: ``set_to_none`` (the default) sets their
    gradients to None as ``nn.Module.zero_grad`` does, without its walk of every module; zeroing in place is left to
    the module's own."""

    def __init__(self, model: torch.nn.Module, parameters: list[torch.nn.Parameter]) -> None:
        self.model = model
        self.parameters = parameters

    def __call__(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            torch.nn.Module.zero_grad(self.model, set_to_none=False)
            return
        for parameter in self.parameters:
            parameter.grad = None
