"""The compiled executor: the plan as AOTAutograd's partition, forward and backward compiled by inductor.

Inductor's fused kernels round differently from eager and from each other, so training is compared with plain
``torch.compile`` of the same model: losses and gradients to float tolerance; BatchNorm's step counter, the global
RNG stream and the dropout masks exactly (a different mask would move the gradients far beyond the tolerance).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import types

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import sublinear
from sublinear.capture.joint import JointTraceError, trace_joint
from sublinear.execute.compiled import CompiledGraph
from sublinear.profiling.compiled import profile_joint
from sublinear.execute.compiled import executor as compiled_executor
from sublinear.core import Plan, StorageState, analyse
from sublinear.measurement import measure_cpu_allocator
from sublinear.training import default_loss, training_step
from sublinear.simulation.timeline import simulate

from conftest import PLAIN, LossAndWideOutput, ResidualNet, train_steps

INDUCTOR = dataclasses.replace(PLAIN, compiler="inductor")


def recomputing_plan(profile) -> Plan:
    """A plan that drops and rebuilds most of the step: a block per three ops."""
    return Plan.of(range(2, profile.num_ops, 3), profile.num_ops)


def close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), rtol=rtol, atol=atol) for k in a)


def unprefixed(state: dict) -> dict:
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


@pytest.fixture(scope="module")
def residual_training():
    """ResidualNet (convolutions, BatchNorm, in-place ReLU, max-pool indices, dropout) trained two SGD steps under
    a recomputing plan compiled by inductor, and under plain torch.compile; with the compiled graph that ran."""
    torch.manual_seed(0)
    base = ResidualNet(blocks=1).train()
    x = torch.randn(4, 3, 16, 16)
    model = copy.deepcopy(base)
    compiled = sublinear.compile(model, (x,), config=INDUCTOR)
    plan = recomputing_plan(compiled.sublinear_profile)
    compiled.use(plan)
    planned = train_steps(compiled, (x,), steps=2)
    graph = next(iter(compiled.sublinear_backend.latest.values())).rewritten
    # Static, as the planned graph: TorchDynamo makes sizes dynamic for a forward it saw at other shapes before in
    # the process (ResidualNet.forward is shared by every test), and dynamic kernels round differently.
    reference = train_steps(torch.compile(copy.deepcopy(base), dynamic=False), (x,), steps=2)
    return planned, tuple(unprefixed(part) if isinstance(part, dict) else part for part in reference), graph


@pytest.mark.slow
def test_a_recomputing_plan_runs_compiled_as_planned(residual_training):
    _, _, graph = residual_training
    assert isinstance(graph, CompiledGraph)
    assert graph.partitioner.applied
    assert any(graph.partitioner.tags.values())  # forward nodes backward recomputes


def test_compiled_gradients_match_torch_compile(residual_training):
    (losses, grads, _, _), (ref_losses, ref_grads, _, _), _ = residual_training
    assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(losses, ref_losses))
    assert close(grads, ref_grads)


def test_compiled_batchnorm_statistics_update_once(residual_training):
    (_, _, state, _), (_, _, ref_state, _), _ = residual_training
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    assert counters and all(state[k].item() == 2 for k in counters)  # two steps, recompute included
    assert close(state, ref_state)


@pytest.mark.slow
def test_compiled_rng_stream_and_dropout_masks_match_torch_compile(residual_training):
    (_, grads, _, rng), (_, ref_grads, _, ref_rng), _ = residual_training
    assert torch.equal(rng, ref_rng)
    assert torch.allclose(grads["fc.weight"], ref_grads["fc.weight"], rtol=1e-4, atol=1e-6)  # behind the dropout


@pytest.mark.slow
def test_forward_saves_exactly_what_the_plan_keeps(monkeypatch):
    """The partition's saved values are the storages the plan retains for backward or for a recompute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).train()
    x = torch.randn(16, 32)
    compiled = sublinear.compile(model, (x,), config=INDUCTOR)
    profile = compiled.sublinear_profile
    plan = recomputing_plan(profile)
    compiled.use(plan)
    saved = {}
    partition = compiled_executor.PlanPartitioner.__call__

    def recording(self, gm, joint_inputs, **kwargs):
        fw, bw = partition(self, gm, joint_inputs, **kwargs)
        outputs = list(fw.graph.nodes)[-1].args[0][kwargs["num_fwd_outputs"]:]
        saved["names"] = {n.name for n in outputs if not n.name.startswith("primals")}
        return fw, bw

    monkeypatch.setattr(compiled_executor.PlanPartitioner, "__call__", recording)
    default_loss(compiled(x)).backward()
    graph = next(iter(compiled.sublinear_backend.latest.values())).rewritten
    a = analyse(profile, plan)
    names = list(graph.partitioner.tags)
    read_by_recompute = {s for o in a.recompute_pairs[1] for _, storages in profile.op_inputs[o] for s in storages}
    expected = {s for s in range(len(profile.storage_bytes)) if a.state[s] == StorageState.RETAINED
                and (profile.arrays.saved_reaching[s] or s in read_by_recompute)}
    got = {s for i, name in enumerate(names) if name in saved["names"] for s in profile.node_storages[i] if s >= 0}
    assert expected and got == expected
    assert any(a.state == StorageState.REBUILT)


@pytest.mark.slow
def test_compiled_prediction_matches_the_cpu_allocator():
    """Predicted peak of the compiled step, before compiling and as compiled, against the CPU allocator's own count,
    eager plan and recomputing plan, for the step predictions describe (the output held while backward runs)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.LayerNorm(512))
                            for _ in range(4)]).train()
    x = torch.randn(256, 512)
    compiled = sublinear.compile(model, (x,), config=INDUCTOR)
    profile = compiled.sublinear_profile

    for plan in (Plan.no_split(profile.num_ops), recomputing_plan(profile)):
        compiled.use(plan)
        training_step(compiled, x)  # compile
        model.zero_grad(set_to_none=True)
        measured = measure_cpu_allocator(training_step, compiled, x).peak_bytes
        model.zero_grad(set_to_none=True)
        simulated = simulate(profile, plan).peak_bytes
        as_compiled = compiled.sublinear_plan.graphs[0].compiled_peak_bytes  # the compiled code, walked
        assert compiled.sublinear_plan.graphs[0].executor == "inductor"
        assert abs(measured - simulated) / measured < 0.02, (plan.num_blocks, measured, simulated)
        assert abs(measured - as_compiled) / measured < 0.005, (plan.num_blocks, measured, as_compiled)
        assert compiled.sublinear_plan.predicted_peak_bytes >= as_compiled


@pytest.mark.slow
def test_compiled_budget_plan_stays_within_its_budget():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)])
    x = torch.randn(256, 256)
    lowest = sublinear.compile(copy.deepcopy(model), (x,), config=INDUCTOR).sublinear_plan  # no budget: lowest peak
    budget = (lowest.predicted_peak_bytes + lowest.baseline_peak_bytes) // 2
    config = dataclasses.replace(INDUCTOR, memory_budget=budget)
    compiled = sublinear.compile(model, (x,), config=config)
    assert compiled.sublinear_plan.predicted_peak_bytes <= budget

    def step(m):
        default_loss(m(x)).backward()

    step(compiled)
    model.zero_grad(set_to_none=True)
    assert measure_cpu_allocator(step, compiled).peak_bytes <= budget


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient (so a lost custom backward shows in the gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = F.gelu(self.a(x))
        h = _ScaleGrad.apply(torch.tanh(self.b(h)))
        return self.c(h)


def test_compiled_autograd_function_keeps_its_backward():
    torch.manual_seed(0)
    base = _WithFunction().train()
    x = torch.randn(8, 32)
    compiled = sublinear.compile(copy.deepcopy(base), (x,), config=INDUCTOR)
    compiled.use(recomputing_plan(compiled.sublinear_profile))
    _, grads, _, _ = train_steps(compiled, (x,), steps=1)
    _, ref_grads, _, _ = train_steps(copy.deepcopy(base), (x,), steps=1)
    assert close(grads, ref_grads)


@pytest.mark.slow
def test_compiled_bf16_autocast_matches_torch_compile():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.Dropout(0.1), nn.Linear(128, 8))
    x = torch.randn(16, 64)

    def training(module):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = default_loss(module(x))
        loss.backward()
        return loss.detach(), {k.removeprefix("_orig_mod."): p.grad for k, p in module.named_parameters()}

    model = copy.deepcopy(base).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = sublinear.compile(model, (x,), config=INDUCTOR)
    assert compiled.sublinear_profile.ops[0].name  # planned at the dtypes autocast makes
    compiled.use(recomputing_plan(compiled.sublinear_profile))
    loss, grads = training(compiled)
    ref_loss, ref_grads = training(torch.compile(copy.deepcopy(base).train()))
    assert torch.allclose(loss.float(), ref_loss.float(), rtol=1e-2)
    assert close(grads, ref_grads, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_a_graph_inductor_cannot_trace_runs_on_the_eager_executor(monkeypatch, caplog):
    def refuse(*_args, **_kwargs):
        raise JointTraceError("RuntimeError: no lowering for this op")

    monkeypatch.setattr("sublinear.runtime.pipeline.trace_joint", refuse)
    torch.manual_seed(0)
    base = ResidualNet().train()
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        compiled = sublinear.compile(copy.deepcopy(base), (x,), config=INDUCTOR)
    assert "eager executor" in caplog.text and "no lowering" in caplog.text
    executor = compiled.sublinear_plan.graphs[0].executor  # the plan says where the graph runs, and why
    assert executor.startswith("sublinear's eager executor (inductor could not trace") and "no lowering" in executor
    eager = train_steps(copy.deepcopy(base), (x,), steps=1)
    planned = train_steps(compiled, (x,), steps=1)
    assert all(torch.equal(a, b) for a, b in zip(eager[0], planned[0]))  # the eager executor is exact


@pytest.mark.slow
def test_the_joint_graph_names_every_forward_node_after_its_captured_node():
    torch.manual_seed(0)
    model = ResidualNet().train()
    graph = sublinear.capture.dynamo.capture(model, (torch.randn(2, 3, 8, 8),)).graph
    joint = trace_joint(graph, graph.example_values)
    profile = profile_joint(joint, graph, None).profile
    assert len(profile.op_of_node) == len(joint.forward)
    named = [op.name for op in profile.ops]
    assert any(name.startswith("blocks.0.c1") for name in named) and any(name.startswith("fc") for name in named)


def holding_more_in_backward(monkeypatch, extras: list[int]) -> None:
    """Each compiled step's walk holds the last of ``extras`` (taken from the list) more bytes through backward,
    then none once the list is empty."""
    step_memory = compiled_executor._step_memory

    def holding_more(graphs, sizes, device, origins, uses):
        memory = step_memory(graphs, sizes, device, origins, uses)
        extra = extras.pop() if extras else 0
        trace = tuple(dataclasses.replace(p, live=p.live + extra) if p.phase == "backward" else p
                      for p in memory.trace)
        return dataclasses.replace(memory, peak=max(memory.peak, memory.backward_peak + extra), trace=trace)

    monkeypatch.setattr(compiled_executor, "_step_memory", holding_more)


@pytest.mark.slow
def test_a_compiled_step_above_its_budget_is_planned_again_on_what_it_held(monkeypatch):
    """Where the compiled code holds more than predicted, the profile learns what it held and the plan is searched
    again on it for the same budget (never a cut budget), so the step compiled next fits."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)])
    x = torch.randn(256, 256)
    lowest = sublinear.compile(copy.deepcopy(model), (x,), config=INDUCTOR).sublinear_plan
    budget = (lowest.predicted_peak_bytes + lowest.baseline_peak_bytes) // 2
    extras = [budget - lowest.predicted_peak_bytes]  # the first compiled plan holds the whole headroom beyond it

    holding_more_in_backward(monkeypatch, extras)
    compiled = sublinear.compile(model, (x,), config=dataclasses.replace(INDUCTOR, memory_budget=budget))
    default_loss(compiled(x)).backward()
    plan = compiled.sublinear_plan.graphs[0]
    assert not extras  # the first plan compiled held more than its budget
    assert plan.compiled_peak_bytes <= budget and plan.predicted_peak_bytes <= budget
    assert plan.predicted_before_compile_bytes is not None


@pytest.mark.slow
def test_a_compiled_step_over_its_budget_only_by_outputs_guessed_held_is_checked_again_not_compiled_again(
        monkeypatch):
    """The first call guesses held the outputs no loss reads. A compiled step above the budget by less than them is
    checked again when a call shows the caller dropping them, with the same plan and compiled code: one search, one
    compile, and the step within its budget."""
    from sublinear.runtime import compile_check, pipeline

    x = torch.randn(64, 32)

    def fresh():
        torch.manual_seed(0)
        return LossAndWideOutput().train()

    # The plan is predicted at the budget, where its wrapper code would be read before it is built; the case here is
    # the compiled step's own walk above the budget, so no wrapper code is read (each read compiles the graph's code
    # without building its kernels, which the count below would see).
    monkeypatch.setattr(compile_check, "_unbuilt_over", lambda runtime, variant, values: None)
    monkeypatch.setattr(compile_check, "_faster_fitting", lambda runtime, variant, values: None)
    free = sublinear.apply(fresh(), INDUCTOR)  # no budget: the lowest peak, planned with the wide output held
    free(x)[0].backward()
    plan = free.sublinear_plan.graphs[0]
    held_budget = plan.predicted_peak_bytes
    wide = 64 * 512 * 4
    searches, compiles = [], []
    make_plan = pipeline.make_plan
    monkeypatch.setattr(pipeline, "make_plan", lambda *a, **k: searches.append(1) or make_plan(*a, **k))
    compile_ = CompiledGraph._compile
    monkeypatch.setattr(CompiledGraph, "_compile", lambda self, *a: compiles.append(1) or compile_(self, *a))
    extras = [held_budget - plan.compiled_peak_bytes + wide // 2]  # the first walk: over by half the wide output

    holding_more_in_backward(monkeypatch, extras)
    model = fresh()
    run = sublinear.apply(model, dataclasses.replace(INDUCTOR, memory_budget=held_budget))
    for _ in range(3):
        loss, _wide = run(x)
        del _wide
        loss.backward()
        model.zero_grad(set_to_none=True)
    assert not extras  # the first compiled step was walked above its budget
    assert (len(searches), len(compiles)) == (1, 1)
    assert model.sublinear_plan.predicted_peak_bytes <= held_budget


class _SetsWhatItReadsAtItsFirstCall(nn.Module):
    """Sets a config attribute its forward reads, as Hugging Face's classifiers set ``config.problem_type`` at
    their first call: TorchDynamo's guard on it fails at the second call, which captures the same graph again."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
        self.config = types.SimpleNamespace(problem_type=None)

    def forward(self, x):
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        return self.net(x)


def test_a_graph_captured_again_keeps_its_plan_and_compiled_code(monkeypatch):
    """The graph captured again is the one planned and compiled at the first call, its profile since taught by the
    compile check: its plan, still meeting the objective there, and its compiled code serve (one search, one
    compile: a second cost as much as the first call's planning)."""
    from sublinear.runtime import pipeline

    searches, compiles = [], []
    make_plan = pipeline.make_plan
    monkeypatch.setattr(pipeline, "make_plan", lambda *a, **k: searches.append(1) or make_plan(*a, **k))
    compile_ = CompiledGraph._compile
    monkeypatch.setattr(CompiledGraph, "_compile", lambda self, *a: compiles.append(1) or compile_(self, *a))
    torch.manual_seed(0)
    model = _SetsWhatItReadsAtItsFirstCall().train()
    applied = sublinear.apply(model, INDUCTOR)
    for _ in range(3):
        out = applied(torch.randn(64, 32))  # held through backward: the uses the first call guessed
        default_loss(out).backward()
    graphs = model.forward.sublinear_backend.graphs
    assert len(graphs) == 2 and graphs[0].graph.code == graphs[1].graph.code  # captured again
    assert (len(searches), len(compiles)) == (1, 1)


_COMPILE_ONCE = """
import copy, torch, sublinear
from torch import nn
from sublinear.core import Plan
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32)).train()
x = torch.randn(16, 32)
config = sublinear.SublinearMemoryConfig(compiler="inductor", memory_budget=None, cache_dir="", cost_model="estimate",
                                         max_sizes={"input": (16, None)})  # a dynamic graph
compiled = sublinear.compile(model, (x,), config=config)
n = compiled.sublinear_profile.num_ops
compiled.use(Plan.of(range(2, n, 3), n))
compiled(x).sum().backward()
graph = next(iter(compiled.sublinear_backend.latest.values())).rewritten
print(graph.partitioner.applied, graph.peak_bytes is not None)
"""


@pytest.mark.slow
def test_a_graph_compiled_again_in_a_new_process_is_partitioned_by_the_plan_again(tmp_path):
    """The second process compiling the same graph under the same plan finds torch's compile caches warm; the
    plan's partitioner still runs and the compiled graphs' memory is still read (no cached artifact answers)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        assert out[-2:] == ["True", "True"], out


def _product_graph(tokens: int, addend_after: bool):
    """A tied weight's gradient: a product (vocabulary x hidden) plus a value made after it (or before)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def gradient(logits_grad, hidden, embedding_grad):
        before = embedding_grad * 2
        product = torch.ops.aten.mm(logits_grad.t(), hidden)
        return product + (embedding_grad * 3 if addend_after else before)

    return make_fx(gradient, tracing_mode="fake")(torch.randn(tokens, 100), torch.randn(tokens, 8),
                                                   torch.randn(100, 8)).graph


def _guards(graph) -> list:
    return [n for n in graph.nodes if n.target is torch.ops.aten.permute.default]


@pytest.mark.parametrize("tokens, addend_after, guarded", [(64, True, True), (64, False, False), (4, True, False)],
                         ids=["operands-outweigh-a-later-sum", "sum-made-before", "product-outweighs-its-operands"])
def test_a_product_is_kept_apart_from_a_sum_made_after_it_where_its_operands_outweigh_it(tokens, addend_after,
                                                                                           guarded):
    from sublinear.execute.compiled.products import DropProductGuards, GuardDeferredProducts

    graph = _product_graph(tokens, addend_after)
    GuardDeferredProducts()(graph)
    guards = _guards(graph)
    assert len(guards) == guarded
    if guarded:
        assert guards[0].args[0].target is torch.ops.aten.mm.default and len(guards[0].args[0].users) == 2
    DropProductGuards()(graph)
    assert not _guards(graph)
    graph.lint()


@pytest.mark.slow
def test_a_tied_heads_weight_gradient_is_made_at_the_head_not_with_the_embeddings_at_the_end():
    """Inductor's post-grad pattern would make the head's product one ``addmm`` with the embedding's gradient at the
    end of backward, holding the logits' gradient until then."""
    from test_compiled_memory import _TiedHead

    torch.manual_seed(0)
    model = _TiedHead().train()
    x = torch.randn(4, 64, 64)
    compiled = sublinear.compile(model, (x,), config=dataclasses.replace(INDUCTOR, chunk_lm_heads=False))
    compiled.use(Plan.no_split(compiled.sublinear_profile.num_ops))  # backward re-runs no forward linear's addmm
    _, sources = run_and_get_code(lambda: compiled(x).backward())
    backward = [source for source in sources if "tangents_1" in source]
    assert len(sources) == 2 and len(backward) == 1 and "extern_kernels.mm(" in backward[0]
    assert "extern_kernels.addmm(" not in backward[0]


@pytest.mark.slow
def test_forward_saves_no_constant_for_backward():
    """Hugging Face's GPT-2 fills masked attention with one zeros constant that the graph's common-subexpression
    pass shares between layers; layers re-run in backward read it. Saved, it would be an attention-sized buffer
    from the first layer's forward to the last reader's backward; backward's kernels make its values themselves."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 100, (2, 64))
    plain = dataclasses.replace(INDUCTOR, chunk_lm_heads=False)
    compiled = sublinear.compile(model, example_kwargs=dict(input_ids=ids, labels=ids), config=plain)
    n = compiled.sublinear_profile.num_ops
    compiled.use(Plan.of([n // 2, n - 4], n))  # the layers of the first block re-run for the second's backward
    with torch._inductor.config.patch(fallback_random=True):
        _, sources = run_and_get_code(lambda: compiled(input_ids=ids, labels=ids).loss.backward())
    (backward,) = [source for source in sources if "tangents_1" in source]
    (unpack,) = [line for line in backward.splitlines() if line.strip().endswith("= args")]
    saved = [name.strip() for name in unpack.split("=")[0].split(",")]
    assert "tangents_1" in saved and not [name for name in saved if name.startswith("full")]


def _gradient_then_a_rerun(x, w, grad):
    """A backward's pointwise gradient, a convolution re-run after it, and the convolution's backward reading both."""
    gradient = torch.ops.aten.mul.Tensor(grad, 2.0)
    rerun = torch.ops.aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    return torch.ops.aten.convolution_backward.default(gradient, rerun, w, [0], [1, 1], [1, 1], [1, 1], False,
                                                       [0, 0], 1, [True, True, False])


def test_a_value_only_library_calls_read_is_stored_where_computed_when_a_library_call_runs_between():
    """Inductor computes such a value when it lowers its first reader: after the re-run convolution, holding what it
    is made from through that re-run. Tagged, it is stored where the graph computes it; with no library call
    between the two, nothing is tagged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w, grad = torch.randn(2, 4, 8, 8), torch.randn(4, 4, 3, 3), torch.randn(2, 4, 8, 8)
    backward = make_fx(_gradient_then_a_rerun)(x, w, grad)
    compiled_executor.realized_in_place(backward, channels_last=False)
    tagged = {n.name for n in backward.graph.nodes if n.meta.get("inductor_realize_to_strides")}
    assert tagged == {"mul"}

    backward = make_fx(lambda x, w, grad: torch.ops.aten.convolution_backward.default(
        torch.ops.aten.mul.Tensor(grad, 2.0), x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [True, True, False]))(x, w, grad)
    compiled_executor.realized_in_place(backward, channels_last=True)
    assert not any(n.meta.get("inductor_realize_to_strides") for n in backward.graph.nodes)


def test_a_gradient_a_convolutions_backward_reads_beside_a_channels_last_input_is_stored_channels_last():
    """Stored at its traced strides (contiguous), the value would be copied into the convolution's layout where the
    call is lowered, and both held from the kernel that makes them: a channels-last copy of it is stored instead,
    which the convolution's backward reads. Beside a contiguous input the value itself is stored."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w, grad = torch.randn(4, 4, 3, 3), torch.randn(2, 4, 8, 8)
    for x, copied in ((torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last), True),
                      (torch.randn(2, 4, 8, 8), False)):
        backward = make_fx(_gradient_then_a_rerun)(x, w, grad)
        compiled_executor.realized_in_place(backward, channels_last=False)
        tagged = [n for n in backward.graph.nodes if n.meta.get("inductor_realize_to_strides")]
        (call,) = backward.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution_backward.default)
        assert tagged == [call.args[0]]
        if copied:
            assert call.args[0].target is torch.ops.aten.clone.default
            assert call.args[0].kwargs["memory_format"] == torch.channels_last
            assert call.args[0].args[0].name == "mul" and backward(x, w, grad)[0].is_contiguous(
                memory_format=torch.channels_last)
        else:
            assert call.args[0].name == "mul"


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_value_a_channels_last_convolution_reads_reshaped_is_stored_where_computed(channels_last):
    """A group norm's input gradient is computed per group and reshaped for the convolution's backward. Stored when
    the convolution's lowering asks for it, it is laid out contiguous and copied into channels-last; tagged, it is
    stored where it is computed, following its channels-last inputs. Convolutions as traced copy nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def per_group_then_convolution(x, w, grad):
        per_group = torch.ops.aten.mul.Tensor(grad.reshape(2, 2, 2, 64), 2.0)
        return torch.ops.aten.convolution_backward.default(
            per_group.reshape(2, 4, 8, 8), x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])

    backward = make_fx(per_group_then_convolution)(torch.randn(2, 4, 8, 8), torch.randn(4, 4, 3, 3),
                                                   torch.randn(2, 4, 8, 8))
    compiled_executor.realized_in_place(backward, channels_last=channels_last)
    tagged = {n.name for n in backward.graph.nodes if n.meta.get("inductor_realize_to_strides")}
    assert tagged == ({"mul"} if channels_last else set())


class _NormedBlocks(nn.Module):
    """Two residual group-norm blocks around a convolution, as a diffusers decoder's up-block: the convolution's
    backward reads the gradient summed from the block above and its input, re-run from the block below."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.low, self.high = ([nn.Sequential(nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, width, 3, padding=1))
                                for _ in range(2)])
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        h = self.conv(x + self.low(x))
        return (h + self.high(h)).mean((2, 3))


@pytest.mark.slow
def test_a_gradient_a_convolutions_backward_reads_does_not_wait_across_the_re_run_of_its_input(monkeypatch):
    """The group norm's input gradient summed with the residual's is stored before the block below is re-run for
    the convolution's backward: the norm's input and the gradients it is made from are let go before the re-run
    (left to inductor, the sum was computed after the re-run and held them through it: one activation more)."""
    x = torch.randn(16, 32, 16, 16)
    activation = x.numel() * x.element_size()

    def measured() -> int:
        torch.manual_seed(0)
        model = _NormedBlocks().train()
        compiled = sublinear.compile(model, (x,), config=INDUCTOR)
        compiled.use(Plan.of([compiled.sublinear_profile.num_ops // 2], compiled.sublinear_profile.num_ops))
        training_step(compiled, x)
        model.zero_grad(set_to_none=True)
        peak = measure_cpu_allocator(training_step, compiled, x).peak_bytes
        walked = compiled.sublinear_plan.graphs[0].compiled_peak_bytes
        assert abs(walked - peak) <= 0.005 * peak, (walked, peak)
        torch._dynamo.reset()
        return peak

    stored = measured()
    monkeypatch.setattr(compiled_executor, "realized_in_place", lambda backward, channels_last: None)
    assert measured() >= stored + 0.8 * activation


@pytest.mark.slow
def test_inductors_vector_isa_probe_runs_in_the_background_from_the_first_call_and_the_compile_waits_for_it(
        monkeypatch):
    """The probe starts at the first training call, before the graph is captured and compiled, in its own thread;
    inductor's first call of it in the compile comes after the probe has finished (so it never probes twice)."""
    from torch._inductor import cpu_vec_isa

    from sublinear.execute.compiled import toolchain

    probed = cpu_vec_isa.valid_vec_isa_list  # the process's cached result: the calls below only record
    calls: list[tuple[str, str]] = []
    compiling = threading.Event()

    def recorded() -> list:
        name = threading.current_thread().name
        calls.append(("begin", name))
        if name == "sublinear-inductor-isa-probe":
            assert compiling.wait(timeout=300), "the compile never started"
        result = probed()
        calls.append(("end", name))
        return result

    compile_ = CompiledGraph._compile

    def compile_started(self, *args, **kwargs):
        compiling.set()
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", recorded)
    monkeypatch.setattr(CompiledGraph, "_compile", compile_started)
    monkeypatch.setattr(toolchain, "_probe", None)
    torch.manual_seed(0)
    model = sublinear.apply(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).train(), INDUCTOR)
    training_step(model, torch.randn(8, 32))
    probe = ("begin", "sublinear-inductor-isa-probe")
    assert calls and calls[0] == probe, calls
    compiler_calls = [i for i, (_, name) in enumerate(calls) if name != probe[1]]
    assert compiler_calls, "inductor never asked for the vector instruction sets"
    assert calls.index(("end", probe[1])) < compiler_calls[0], calls
