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

pytestmark = pytest.mark.slow  # every case spawns two processes with a gloo group (5-20 s each on 2 cores)

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
    if mode in ("ddp", "ddp-inductor"):
        config = sublinear.SublinearMemoryConfig(compiler="inductor" if mode == "ddp-inductor" else "eager")
        compiled = sublinear.compile(model, x, config=config)
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
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        compiled = sublinear.compile(model, x)
        fully_shard(compiled)
        compiled(x).sum().backward()
        blocks = compiled.sublinear_plan.num_blocks
        assert compiled.sublinear_profile.sharding.world_size == WORLD  # planned again for the FSDP layout
    else:  # FSDP unit per compiled stage, then the root
        from torch.distributed.fsdp import fully_shard

        from conftest import Chain

        half = len(model.layers) // 2
        stages = [Chain(0), Chain(0)]
        stages[0].layers, stages[1].layers = model.layers[:half], model.layers[half:]
        compiled = [sublinear.compile(stage, x) for stage in stages]
        for stage in compiled:
            fully_shard(stage)
        root = fully_shard(nn.Sequential(*compiled))
        root(x).sum().backward()
        blocks = min(stage.sublinear_plan.num_blocks for stage in compiled)
        assert all(stage.sublinear_profile.sharding is not None for stage in compiled)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    if rank == 0:
        torch.save((blocks, [g * WORLD for g in grads]), result_path)  # DDP and FSDP average over ranks


@pytest.mark.parametrize("mode", ["ddp", "ddp-inductor", "ddp-decorator", "fsdp2", "fsdp2-stages"])
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


def _peak_worker(rank, store, cases, result_path):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = [_fsdp_peaks(*case) for case in cases]
        results.append(_nested_unit_error())
        if rank == 0:
            torch.save(results, result_path)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp_peaks(depth, width, batch, reshard_after_forward):
    """(predicted, measured) peak of a rank's FSDP2 step after the first (the least of five), and the prediction
    that ignores the sharding."""
    import dataclasses

    import sublinear
    from conftest import Chain
    from sublinear.training import training_step
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    x = torch.randn(batch, width)
    compiled = sublinear.compile(Chain(depth, width), x)
    fully_shard(compiled, reshard_after_forward=reshard_after_forward)
    training_step(compiled, x)  # plans for the FSDP layout; FSDP initialises lazily
    measured = []
    for _ in range(5):
        for p in compiled.parameters():
            p.grad = None
        measured.append(sublinear.measure_cpu_allocator(training_step, compiled, x).peak_bytes)
    measured = min(measured)  # a free done on a gloo worker thread is not seen, so a step's count errs only upward
    graph_profile, plan = compiled.sublinear_profile, compiled.sublinear_plan
    unsharded = sublinear.simulate(dataclasses.replace(graph_profile, sharding=None), plan.to_plan()).peak_bytes
    return plan.predicted_peak_bytes, measured, unsharded


def _nested_unit_error():
    """The errors for an FSDP unit inside the model: sharded before compile, and sharded after it."""
    import sublinear
    from torch.distributed.fsdp import fully_shard

    x = _data()[:PER_RANK]
    errors = []
    for shard_first in (True, False):
        model = _model()
        try:
            if shard_first:
                fully_shard(model.layers[0])
            compiled = sublinear.compile(model, x)
            if not shard_first:
                fully_shard(model.layers[0])
                compiled(x)
        except ValueError as exc:
            errors.append(str(exc))
        else:
            errors.append(None)
    return errors


def test_fsdp2_rank_peak_counts_sharded_parameters_and_gradients(tmp_path):
    """Predicted per-rank peak under fully_shard equals the CPU allocator's count of a real step (gloo): parameter
    shards, gathered parameters, all-gather and reduce-scatter buffers, and gloo's copies of them."""
    cases = [(8, 256, 64, None), (8, 256, 512, True), (4, 512, 256, False)]
    result_path = str(tmp_path / "peaks.pt")
    mp.start_processes(_peak_worker, args=(str(tmp_path / "store"), cases, result_path), nprocs=WORLD, join=True,
                       start_method="spawn")
    *peaks, nested_errors = torch.load(result_path)
    for case, (predicted, measured, unsharded) in zip(cases, peaks):
        assert abs(predicted - measured) <= 1e-3 * measured, (case, predicted, measured)
        assert abs(unsharded - measured) > 0.05 * measured, (case, unsharded, measured)  # sharding matters here
    for nested_error in nested_errors:
        assert nested_error is not None and "layers.0" in nested_error and "fully_shard on the compiled" in nested_error
