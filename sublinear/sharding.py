"""How FSDP2 lays out a rank's parameters and gradients across one training step, in plain numbers.

``fully_shard(compiled)`` makes the compiled module one FSDP unit. Per rank, the step then holds: the parameter
shards, always; the all-gathered (unsharded) parameters from the forward's start until FSDP reshards them after
backward; the all-gather output buffer through the forward; and, after backward, the reduce-scatter input and
output buffers that turn the full gradients into gradient shards. Gloo, which lacks native reduce-scatter and
in-place all-gather, also copies each collective's full buffer; NCCL does not. The simulator adds these to the
step it profiled (:func:`sublinear.simulator.timeline`); this module reads them from FSDP's own state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

__all__ = ["ShardedParameters", "fsdp_sharding", "refuse_nested_fsdp"]


@dataclass(frozen=True)
class ShardedParameters:
    """One rank's parameter and gradient bytes under FSDP2 (shards are padded to equal size, as FSDP stores them)."""

    world_size: int
    sharded_bytes: int  # the rank's parameter shards, held across steps
    unsharded_bytes: int  # the all-gathered parameters (padded), held from forward until reshard after backward
    reduce_scatter_bytes: int  # the reduce-scatter input: every rank's padded gradients, in the reduce dtype
    sharded_gradient_bytes: int  # the rank's gradient shards the step leaves behind
    collective_workspace: bool  # the backend copies a collective's full buffer while it runs (gloo)
    reshard_after_forward: bool  # parameters freed after forward and gathered again for backward
    casts_inputs: bool  # a MixedPrecisionPolicy casts floating inputs; the caller's originals are not counted

    @property
    def all_gather_bytes(self) -> int:
        """The all-gather output buffer, held through the forward: every rank's shard at the gathered dtype."""
        return self.unsharded_bytes

    def workspace(self, buffer_bytes: int) -> int:
        """The backend's copy of a collective's buffer while the collective runs."""
        return buffer_bytes if self.collective_workspace else 0

    def __str__(self) -> str:
        mib = 2**20
        return (f"FSDP over {self.world_size} ranks: parameter shards {self.sharded_bytes / mib:.1f} MiB, "
                f"gathered {self.unsharded_bytes / mib:.1f} MiB")


def refuse_nested_fsdp(module: nn.Module) -> None:
    """Raise when FSDP units sit inside ``module``: a compiled graph calls their operators directly, so their
    hooks (all-gather before use, reduce-scatter after backward) would never run."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
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
    policy = group.mp_policy
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
        collective_workspace=backend == "gloo", reshard_after_forward=group.post_forward_mesh_info is not None,
        casts_inputs=policy.param_dtype is not None and policy.cast_forward_inputs)
