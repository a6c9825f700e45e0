"""Two processes on CPU (gloo over a file store): DDP and FSDP2 around compiled modules.

Gradients after one step must equal single-process training on the concatenated batch. Each rank plans for its
own (per-rank) batch. The models avoid BatchNorm and dropout, whose batch statistics and random streams are per
rank by design.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
PER_RANK = 64


def _model():
    from conftest import Chain

    torch.manual_seed(0)
    return Chain(16, width=16)


def _data():
    return torch.randn(WORLD * PER_RANK, 16, generator=torch.Generator().manual_seed(1))


def _worker(rank, store, mode, result_path):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        _train(rank, mode, result_path)
        gc.collect()  # DDP/FSDP objects hold the process group: free them before it is destroyed, not at exit
        dist.barrier()  # no rank tears its gloo connections down while the other still uses them
    finally:
        dist.destroy_process_group()


def _train(rank, mode, result_path):
    import sublinear

    x = _data()[rank * PER_RANK:(rank + 1) * PER_RANK]
    model = _model()
    if mode == "ddp":
        compiled = sublinear.compile(model, x)
        net = nn.parallel.DistributedDataParallel(compiled)
        net(x).sum().backward()
        blocks = compiled.sublinear_plan.num_blocks
    elif mode == "ddp-decorator":
        net = nn.parallel.DistributedDataParallel(model)

        @sublinear.trace
        def step(net, x):
            net(x).sum().backward()
            return net.module.sublinear_plan.num_blocks

        blocks = step(net, x)
    else:
        from torch.distributed.fsdp import fully_shard

        compiled = sublinear.compile(model, x)
        fully_shard(compiled)
        compiled(x).sum().backward()
        blocks = compiled.sublinear_plan.num_blocks
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    if rank == 0:
        torch.save((blocks, [g * WORLD for g in grads]), result_path)  # DDP and FSDP average over ranks


@pytest.mark.parametrize("mode", ["ddp", "ddp-decorator", "fsdp2"])
def test_two_processes_match_single_process_on_the_whole_batch(tmp_path, mode):
    result_path = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(str(tmp_path / "store"), mode, result_path), nprocs=WORLD, join=True,
                       start_method="spawn")
    blocks, grads = torch.load(result_path)
    assert blocks > 1  # the ranks really recomputed
    reference = _model()
    reference(_data()).sum().backward()
    for got, expected in zip(grads, (p.grad for p in reference.parameters())):
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
