"""``--bf16_weights``: the model's weights in bf16 while it trains, an fp32 master copy of each in the optimizer.

``--bf16`` alone is autocast: the weights stay fp32 and each is cast to bf16 at every matrix product, forward and
backward (31% of the ``base`` preset's bf16 step on 2 AMX cores went to those casts, docs/results.md). With
``--bf16_weights`` the weights are bf16 for the whole step, with nothing to cast, and the optimizer updates an fp32
copy of each instead, copied back into the bf16 weight after every optimizer step: AdamW's small updates would be
lost to bf16's 8-bit mantissa. Each gradient is added into its fp32 copy as soon as backward produces it, so
accumulation (``--gradient_accumulation_steps``, gradient caching's chunks) and clipping happen in fp32. What
DeepSpeed's ``bf16`` mode does, on one process.

The fp32 copies are what the run saves: checkpoints and the final model hold fp32 weights, as an fp32 run's do, and
every door reads them as it reads any run. A resumed run takes them from its checkpoint: the Trainer loads the
checkpoint into the (still fp32) model before it builds the optimizer, where ``MasterWeights`` copies them, and the
optimizer's own state (index by index) is the copies'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class MasterWeights:
    """Keeps ``model``'s floating-point weights and buffers in bf16 and ``optimizer``'s parameters as their fp32
    copies (see the module docstring).

    Args:
        model: The model, in fp32, with ``optimizer`` built over its parameters.
        optimizer: A ``torch.optim.Optimizer``: its parameter groups are pointed at the fp32 copies, with the state
            it holds for each weight (a trainer trained again after ``release``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        # Every floating parameter has a copy (a frozen one too: the run saves its fp32 value); tied ones share it.
        self._masters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(weight): (weight, its fp32 copy)
        for parameter in model.parameters():
            if parameter.is_floating_point() and id(parameter) not in self._masters:
                self._masters[id(parameter)] = (parameter, nn.Parameter(parameter.detach().float().clone()))
        self._buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()
                         if buffer.is_floating_point()}  # fmt: skip
        _switch_parameters(optimizer, {id(weight): master for weight, master in self._masters.values()})
        optimized = {id(master) for group in optimizer.param_groups for master in group["params"]}
        self._trained = [(weight, master) for weight, master in self._masters.values() if id(master) in optimized]
        self.trained = [master for _, master in self._trained]  # their .grad is the step's gradient: clip these
        model.to(torch.bfloat16)
        self._hooks = [weight.register_post_accumulate_grad_hook(self._take_gradient) for weight, _ in self._trained]
        self._hooks.append(optimizer.register_step_post_hook(self._copy_back))

    def _take_gradient(self, weight: torch.Tensor) -> None:
        master = self._masters[id(weight)][1]
        if master.grad is None:
            master.grad = weight.grad.float()  # type: ignore[union-attr]
        else:
            master.grad.add_(weight.grad)  # type: ignore[arg-type]
        weight.grad = None

    def _copy_back(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            torch._foreach_copy_([weight for weight, _ in self._trained], self.trained)
        for master in self.trained:
            master.grad = None

    @contextmanager
    def fp32(self) -> Iterator[None]:
        """``model`` with its fp32 weights and buffers for the duration (to save it), bf16 again after."""
        held = self._swap_in_fp32()
        try:
            yield
        finally:
            for tensor, data in held:
                tensor.data = data

    def release(self) -> None:
        """Leave ``model`` in fp32 for good (its weights share the copies' storage), stop taking gradients, and point
        the optimizer back at the model's weights with the copies' state: training on with it is fp32 training."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._swap_in_fp32()
        _switch_parameters(self.optimizer, {id(master): weight for weight, master in self._trained})
        for weight, master in self._trained:
            weight.grad = master.grad

    def _swap_in_fp32(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        held = []
        for weight, master in self._masters.values():
            held.append((weight, weight.data))
            weight.data = master.data
        for name, buffer in self.model.named_buffers():
            if name in self._buffers:
                held.append((buffer, buffer.data))
                buffer.data = self._buffers[name]
        return held


def _switch_parameters(optimizer: torch.optim.Optimizer, new_of: dict[int, nn.Parameter]) -> None:
    """Each of ``optimizer``'s parameters replaced by ``new_of[id(parameter)]`` in its group, with its state."""
    for group in optimizer.param_groups:
        for index, old in enumerate(group["params"]):
            new = group["params"][index] = new_of[id(old)]
            if old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)
