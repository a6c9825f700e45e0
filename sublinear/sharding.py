"""How FSDP2 lays out one process's parameters and gradients, read from FSDP's own state.

``fully_shard(compiled)`` makes the compiled module one FSDP unit. The layout (:class:`ShardedParameters`, plain
numbers in the planning core) replaces the profiled full parameters and gradients in the simulation
(:func:`sublinear.simulation.timeline.timeline`).
"""

from __future__ import annotations

import math
import sys

from torch import nn

from sublinear.core.profile import ShardedParameters

__all__ = ["ShardedParameters", "fsdp_sharding", "refuse_nested_fsdp"]


def refuse_nested_fsdp(module: nn.Module) -> None:
    """Raise when FSDP units sit inside ``module``: a compiled graph calls their operators directly, so their
    hooks (all-gather before use, reduce-scatter after backward) would never run. Runs at every call: without
    FSDP imported no module can be an FSDP unit, and the walk over the modules is skipped."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    FSDPModule = fsdp.FSDPModule
    pending = list(module._modules.values())  # a walk without names: the names are made only for the error
    while pending:
        sub = pending.pop()
        if sub is None:
            continue
        if isinstance(sub, FSDPModule):
            break
        pending.extend(sub._modules.values())
    else:
        return
    nested = [name for name, sub in module.named_modules() if sub is not module and isinstance(sub, FSDPModule)]
    if nested:
        raise ValueError(f"FSDP units inside the compiled module ({', '.join(nested[:3])}) would be bypassed by the "
                         "compiled graph. Compile the plain model, then call fully_shard on the compiled module "
                         "(one unit); to shard layer by layer, compile each layer and fully_shard each compiled "
                         "layer and then the root.")


def fsdp_sharding(module: nn.Module) -> ShardedParameters | None:
    """The FSDP2 layout of ``module`` (a ``fully_shard``-ed module), or None when FSDP does not manage it."""
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    if not isinstance(module, FSDPModule):
        return None
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:  # FSDP manages no parameters of this module
        return None
    world = group.mesh_info.shard_mesh_size
    backend = dist.get_backend(group.mesh_info.shard_process_group)
    sharded = unsharded = reduce_input = grad_shards = 0
    for p in group.fsdp_params:
        shard_numel = math.prod(p.padded_sharded_param_size)
        orig = p.orig_dtype
        sharded += shard_numel * orig.itemsize
        unsharded += world * shard_numel * (p.param_dtype or orig).itemsize
        if p.sharded_param.requires_grad:
            reduce_input += world * shard_numel * (p.reduce_dtype or p.param_dtype or orig).itemsize
            grad_shards += shard_numel * orig.itemsize
    return ShardedParameters(
        world_size=world, sharded_bytes=sharded, unsharded_bytes=unsharded,
        reduce_scatter_bytes=reduce_input, sharded_gradient_bytes=grad_shards,
        collective_workspace=backend == "gloo", reshard_after_forward=group.post_forward_mesh_info is not None)
