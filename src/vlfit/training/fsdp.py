"""FSDP2 for vlfit's models, and on CPUs: over gloo, which torch supports and accelerate does not turn on by itself.

accelerate sets ``DistributedType.FSDP`` only for GPUs and other accelerators, so ``--fsdp`` on a CPU machine would
train replicated (DDP) while saying FSDP. The Trainer builds the FSDP plugin from ``--fsdp`` / ``--fsdp_config``
either way; this puts it into the accelerator's state and marks the run FSDP, after which accelerate's own FSDP2
path (``fully_shard`` of the wrapped layers, sharded optimizer state, full state dicts when saving) runs as it
does on GPUs.

``fully_shard`` refuses 0-dimensional parameters, and every contrastive model keeps its ``logit_scale`` as one:
``reshape_scalar_parameters`` makes them 1-element vectors for the run, and ``scalar_state_dict`` gives saved
checkpoints the original shape back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlfit.errors import ConfigError


def enable_fsdp_on_cpu(accelerator: Any, plugin_args: dict[str, Any]) -> bool:
    """Turn a multi-process CPU accelerator into an FSDP one with the plugin ``plugin_args`` describe.

    Returns:
        Whether it did (only for ``DistributedType.MULTI_CPU``: anything else is left as accelerate set it).
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if plugin.fsdp_version != 2:
        raise ConfigError(
            "--fsdp on CPUs runs FSDP2 only (torch's FSDP1 needs CUDA): add --fsdp_config '{\"fsdp_version\": 2}'"
        )
    if "state_dict_type" not in plugin_args:
        # The Trainer writes the final model only from full state dicts (sharded ones go to checkpoints only).
        plugin.set_state_dict_type("FULL_STATE_DICT")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    # Every AcceleratorState() copies PartialState's fields over its own: the type must be FSDP in both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    return True


def reshape_scalar_parameters(model: nn.Module) -> list[str]:
    """Make every 0-dimensional parameter (the contrastive models' ``logit_scale``) a 1-element vector, which
    ``fully_shard`` requires; returns their names, for ``scalar_state_dict`` to put the shape back when saving."""
    names = []
    for module_name, module in model.named_modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.dim() == 0:
                vector = nn.Parameter(parameter.detach().reshape(1), requires_grad=parameter.requires_grad)
                module.register_parameter(name, vector)
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def scalar_state_dict(state_dict: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the parameters ``reshape_scalar_parameters`` reshaped given their 0-d shape back (a
    checkpoint any loader reads)."""
    return {key: value.reshape(()) if key in names else value for key, value in state_dict.items()}
