"""Shared fixtures: small models that exercise the traps (in-place ops, views, BatchNorm, dropout, branches), and
helpers that capture, profile and plan them."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import sublinear
from sublinear.capture.dynamo import capture
from sublinear.config import SublinearMemoryConfig
from sublinear.core import GraphProfile, OpProfile
from sublinear.models.random_dag import RandomDAG  # noqa: F401 - the tests import it from here
from sublinear.profiling.graph import profile
from sublinear.training import default_loss

# Tests run graphs on sublinear's eager executor unless they ask for inductor (tests/test_compiled.py): it is exact
# bit for bit against eager, and it needs no C++ compile per model (seconds each on two cores).
os.environ.setdefault("SUBLINEAR_COMPILER", "eager")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core: each runs its kernels on one thread
    torch.set_num_threads(1)

# The suite compiles hundreds of models of a few classes in one process; TorchDynamo must not give up on them.
torch._dynamo.config.recompile_limit = 10_000
torch._dynamo.config.accumulated_recompile_limit = 100_000

# Plans for exactness tests: no budget, no time cap, no disk cache, op costs estimated (fast, deterministic).
PLAIN = SublinearMemoryConfig(memory_budget=None, max_time_ratio=math.inf, min_memory_per_time=0, cache_dir="",
                              cost_model="estimate")


def profile_of(module: nn.Module, *args, **kwargs):
    """The profile of ``module(*args, **kwargs)``'s only graph, in training mode, with estimated op costs."""
    return profile(capture(module.train(), args, kwargs).graph, cost_model="estimate")


def problem_for(p, **config):
    """A planning problem for profile ``p`` under ``SublinearMemoryConfig(**config)`` (no time cap by default)."""
    from sublinear.planners import PlanningProblem, objective_for

    config = SublinearMemoryConfig(**{"max_time_ratio": math.inf, "memory_budget": None, **config})
    budget = config.memory_budget if isinstance(config.memory_budget, int) else None
    return PlanningProblem(p, objective_for(config, budget), config)


def budget_between(p, fraction: float) -> int:
    """A memory budget ``fraction`` of the way from the grid's lowest predicted peak to eager's."""
    from sublinear.core import Plan
    from sublinear.planners import make_plan
    from sublinear.simulation.timeline import simulate

    lowest = make_plan(p, problem_for(p, planners=("grid",)).config).simulation.peak_bytes
    eager = simulate(p, Plan.no_split(p.num_ops)).peak_bytes
    return int(lowest + (eager - lowest) * fraction)


def compile_with(module: nn.Module, plan_for, args, kwargs=None, config=PLAIN):
    """``module`` compiled at ``args``/``kwargs`` and made to run ``plan_for(num_ops)``; with its profile."""
    compiled = sublinear.compile(module, args, kwargs, config=config)
    p = compiled.sublinear_profile
    compiled.use(plan_for(p.num_ops))
    return compiled, p


class Square(torch.autograd.Function):
    """A custom autograd.Function: squares its input, which it saves for backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Chain(nn.Module):
    """Chen's long chain: ``depth`` Linear+GELU layers of one width, the model on which sqrt(n) checkpointing is
    exact and where planning time grows with the op count (2,000 layers are 4,000 ops)."""

    def __init__(self, depth: int = 100, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


class LossAndWideOutput(nn.Module):
    """A chain whose call returns its loss and a wide tensor no loss reads: the caller may keep it or drop it."""

    def __init__(self) -> None:
        super().__init__()
        self.chain, self.wide = Chain(12, 32), nn.Linear(32, 512)

    def forward(self, x):
        h = self.chain(x)
        return h.square().mean(), self.wide(h)


class ResidualNet(nn.Module):
    """Conv/BN/ReLU(inplace) residual blocks, dropout, a multi-output op (max_pool2d with indices)."""

    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            self.blocks.append(nn.ModuleDict(dict(
                c1=nn.Conv2d(width, width, 3, padding=1, bias=False), b1=nn.BatchNorm2d(width),
                c2=nn.Conv2d(width, width, 3, padding=1, bias=False), b2=nn.BatchNorm2d(width),
                relu=nn.ReLU(inplace=True))))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(width, 5)

    def forward(self, x):
        x = self.stem(x)
        x, _indices = F.max_pool2d(x, 2, return_indices=True)
        for b in self.blocks:
            out = b["relu"](b["b1"](b["c1"](x)))
            out = b["b2"](b["c2"](out))
            out += x
            x = b["relu"](out)
        return self.fc(self.drop(x.mean((2, 3))))


class Branchy(nn.Module):
    """A DAG with chunk/split, views, in-place ops, two inputs, kwargs, a non-tensor argument and two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, y, *, scale: float = 1.0, bias=None):
        h1, h2 = self.a(x).chunk(2, dim=-1)
        h1 = torch.tanh(h1)
        h2 = (h2 + 1).relu_()
        z = self.b(h1).view(-1, 4, 4).transpose(1, 2).reshape(x.shape[0], 16)
        z = self.drop(z) + self.c(y) * scale
        if bias is not None:
            z = z + bias
        parts = torch.split(z, 8, dim=-1)
        w = torch.cat([parts[1], parts[0]], dim=-1)
        w.mul_(2)
        return self.norm(w + h2), h1.sum(-1)


def partitions(monkeypatch) -> list[tuple]:
    """The (forward, backward, number of forward outputs) of every partition the compiled executor makes from here
    on, recorded as its partitioner returns them."""
    from sublinear.execute.compiled.executor import PlanPartitioner

    made: list[tuple] = []
    call = PlanPartitioner.__call__

    def partition(self, gm, joint_inputs, **kwargs):
        forward, backward = call(self, gm, joint_inputs, **kwargs)
        made.append((forward, backward, kwargs["num_fwd_outputs"]))
        return forward, backward

    monkeypatch.setattr(PlanPartitioner, "__call__", partition)
    return made


def train_steps(module, inputs, kwargs=None, steps: int = 2, seed: int = 0, lr: float = 0.1):
    """Run ``steps`` SGD steps under a fixed seed; return losses, final grads, state_dict and the RNG state."""
    kwargs = kwargs or {}
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = default_loss(module(*inputs, **kwargs))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    grads = {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return losses, grads, state, torch.get_rng_state()


def assert_same_training(eager, other) -> None:
    """Bit-for-bit equal losses, gradients, state (BatchNorm statistics included) and RNG state."""
    losses_a, grads_a, state_a, rng_a = eager
    losses_b, grads_b, state_b, rng_b = other
    for a, b in zip(losses_a, losses_b):
        assert torch.equal(a, b), (a, b)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        assert torch.equal(grads_a[k], grads_b[k]), k
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k
    assert torch.equal(rng_a, rng_b)


ROUNDING = 1e-5  # float rounding: of the reference's largest magnitude


def close_to_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float rounding: within ROUNDING of the reference's largest magnitude, or 1e-9 for a value that is
    zero but for rounding noise (attention's key bias gets no gradient in theory)."""
    return bool((a - b).abs().max() <= ROUNDING * b.abs().max() + 1e-9)


def token_batches(lengths: list[int], vocabulary: int = 1000) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four sequences of each length (token ids and labels), the first padded (-100) from its middle."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for length in lengths:
        ids = torch.randint(0, vocabulary, (4, length), generator=g)
        labels = ids.clone()
        labels[0, length // 2:] = -100  # a padded sequence
        batches.append((ids, labels))
    return batches


def train_lm(run, model, batches, keep_logits=False, through_logits=False):
    """Per step the loss, the returned logits (when kept) and every gradient; ``through_logits``: a second loss
    on the returned logits is backpropagated with the model's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    torch.manual_seed(2)  # dropout draws alike
    for ids, labels in batches:
        out = run(input_ids=ids, labels=labels)
        loss, logits = out.loss, out.logits.detach() if keep_logits else None
        total = loss + out.logits.float().square().mean() if through_logits else loss
        del out
        total.backward()
        steps.append((loss.detach(), logits, {k: p.grad.clone() for k, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps


def assert_trains_to_rounding(got, expected) -> None:
    """:func:`train_lm`'s steps equal to float rounding."""
    for (loss, logits, grads), (ref_loss, ref_logits, ref_grads) in zip(got, expected, strict=True):
        assert close_to_rounding(loss, ref_loss), (loss, ref_loss)
        assert logits is None or close_to_rounding(logits, ref_logits)
        assert all(close_to_rounding(grads[k], ref_grads[k]) for k in ref_grads)


@pytest.fixture
def residual_net():
    torch.manual_seed(0)
    return ResidualNet().train()


@pytest.fixture(autouse=True)
def _private_plan_cache(tmp_path, monkeypatch):
    """Each test plans with its own empty plan cache."""
    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path / "plan-cache"))


@pytest.fixture(scope="session")
def meta_resnet50():
    """ResNet-50 at batch 32 on the meta device: (model, example args, profile)."""
    from sublinear.models import get_model

    spec = get_model("resnet50")
    with torch.device("meta"):
        model = spec.build().train()
    args, _ = spec.example_inputs(32, device="meta")
    return model, args, profile_of(model, *args)


# --- Hand-built profiles ---------------------------------------------------------------------------------

def hand_profile(num_ops: int, storages: list[tuple[int, int, tuple[int, ...]]],
                 reads: dict[int, list[tuple[int, tuple[int, ...]]]], outputs: dict[int, tuple[int, ...]] | None = None,
                 reaching: set[int] | None = None, pinned: set[int] = frozenset()) -> GraphProfile:
    """A profile of ``num_ops`` one-node ops. ``storages``: (producer op, last forward reader, ops saving it), 100
    bytes each; ``reads[o]``: (producer op, storages) per value op ``o`` reads; ``outputs[o]``: the storages op
    ``o``'s value lies on (default: the storages it produces; a view lists its base's); ``reaching``: the ops whose
    values reach the graph's outputs (default: all)."""
    outputs = outputs or {}
    produced = {o: tuple(s for s, (p, _, _) in enumerate(storages) if p == o) for o in range(num_ops)}
    op_storages = [outputs.get(o, produced[o]) for o in range(num_ops)]
    saved_at = [tuple(savers) for _, _, savers in storages]
    ops = [OpProfile(index=o, nodes=(o,), name=f"op{o}", flops=1, forward_extra_bytes=0, snapshot_bytes=0,
                     random=False, mutates_state=False, pin_reason="pinned" if o in pinned else "",
                     forward_seconds=1.0) for o in range(num_ops)]
    return GraphProfile(
        ops=ops, storage_bytes=np.full(len(storages), 100, dtype=np.int64),
        storage_producer=np.array([p for p, _, _ in storages], dtype=np.int64),
        storage_last_use=np.array([u for _, u, _ in storages], dtype=np.int64),
        storage_saved_by=saved_at, op_inputs=[tuple(reads.get(o, ())) for o in range(num_ops)],
        baseline_bytes=0, parameter_bytes=0, buffer_bytes=0, input_bytes=0, gradient_bytes=0,
        measured_peak_bytes=0, backward_flops=0, op_of_node={o: o for o in range(num_ops)},
        node_storages={o: op_storages[o] for o in range(num_ops)},
        reaches_output=np.array([reaching is None or o in reaching for o in range(num_ops)], dtype=bool),
        op_storages=op_storages, held_through_forward=np.zeros(len(storages), dtype=bool),
        storage_saved_at=saved_at, node_op=np.arange(num_ops, dtype=np.int64),
        grad_start=np.zeros(num_ops, dtype=np.int64), grad_peak=np.zeros(num_ops, dtype=np.int64),
        grad_after_release=np.zeros(num_ops, dtype=np.int64), backward_seconds=np.zeros(num_ops))


def chain(num_ops: int) -> GraphProfile:
    """Op ``i`` makes storage ``i``; op ``i + 1`` reads it and saves it for backward; the last op's is returned."""
    storages = [(i, i + 1 if i + 1 < num_ops else num_ops, (i + 1,) if i + 1 < num_ops else ()) for i in range(num_ops)]
    return hand_profile(num_ops, storages, {i + 1: [(i, (i,))] for i in range(num_ops - 1)})
