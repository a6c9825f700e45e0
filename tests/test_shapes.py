"""Shape families: a dynamic graph TorchDynamo captures is planned once for a bound on its symbolic sizes and serves
every call at or below it; training over changing shapes stays exact, and a budget holds at every shape served."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import sympy
import torch
from torch import nn
import torch.nn.functional as F

import sublinear
from sublinear.capture.dynamo import compile_entry, receiving
from sublinear.measurement import measure
from sublinear.capture.shapes import SymbolicSizes, argument_dims, bucket, covers, guards_hold, join

from conftest import PLAIN, Square, assert_same_training


class TinyTransformer(nn.Module):
    """Token embedding (with ``positions`` learned positions sliced to the length, as BERT's), two pre-norm
    attention + MLP layers with dropout, a token-level loss head."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2, positions: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(positions, width) * 0.1) if positions else None
        self.layers = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width), "out": nn.Linear(width, width),
            "norm2": nn.LayerNorm(width), "up": nn.Linear(width, 2 * width), "down": nn.Linear(2 * width, width),
        }) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        b, n, w = h.shape
        if self.positions is not None:
            h = h + self.positions[:n]
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["norm1"](h)).view(b, n, 3, self.heads, w // self.heads).unbind(2)
            scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / (w // self.heads) ** 0.5
            attention = F.dropout(scores.softmax(-1), 0.1, self.training)
            h = h + layer["out"](torch.einsum("bhnm,bmhd->bnhd", attention, v).reshape(b, n, w))
            h = h + F.dropout(layer["down"](F.gelu(layer["up"](layer["norm2"](h)))), 0.1, self.training)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


SHAPES = [(2, 16), (3, 24), (4, 9), (2, 31), (5, 12), (3, 20), (4, 28)]  # (batch, length), 7 distinct


def token_batches(shapes, vocab: int = 50):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, shape, generator=g) for shape in shapes]


def train_over(model, batches):
    """One SGD step per batch under a fixed seed: losses, final gradients, state and the RNG state."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


def plans_made(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("sublinear: planned graph")]


# ---------------------------------------------------------------------------------------------------------------
# The pieces


def test_buckets_round_up_to_powers_of_two_and_bounds_cover_what_is_at_or_below():
    assert bucket({"s0": 40, "s1": 64, "s2": 2, "s3": 3}) == {"s0": 64, "s1": 64, "s2": 2, "s3": 4}
    assert covers({"s0": 64, "s1": 8}, {"s0": 64, "s1": 3}) and not covers({"s0": 64}, {"s0": 65})
    assert not covers({"s0": 64}, {"s1": 2})  # a symbol the bound does not know is not covered
    assert join({"s0": 5, "s1": 9}, {"s0": 7}) == {"s0": 7, "s1": 9}


def test_argument_dims_name_the_call_arguments_a_symbol_sizes():
    sources = ["L['args'][0].size()[1]", "L['kwargs']['attention_mask'].size()[0]", "L['ids'].size()[1]",
               "L['args'][0].stride()[0]", "L['args'][3].size()[0]", "L['x'].weight.size()[0]"]
    assert argument_dims(sources, ["input_ids"]) == [("input_ids", 1), ("attention_mask", 0), ("ids", 1)]


def test_guards_hold_reads_each_guard_at_the_binding():
    s0 = sympy.Symbol("s0", integer=True)
    assert guards_hold([s0 <= 128, sympy.Eq(s0 % 2, 0)], {"s0": 64})
    assert not guards_hold([s0 <= 128], {"s0": 130})


class _Keep:
    """A receiver that runs each graph plainly and keeps it."""

    def __init__(self) -> None:
        self.graphs = []

    def run_graph(self, shared, values):
        self.graphs.append((shared.graph, list(values)))
        return shared.graph.graph_module(*values)


def dynamic_graph():
    """The dynamic graph TorchDynamo captures for TinyTransformer once the batch and length changed, with the values
    of two calls."""
    model = TinyTransformer()
    run = compile_entry(model, "TinyTransformer", dynamic=None)
    keep = _Keep()
    with receiving(keep):
        for ids in token_batches([(2, 16), (3, 24), (4, 9)]):
            run(ids)
    (graph, values_a), (same, values_b) = keep.graphs[1], keep.graphs[2]
    assert same is graph  # the third call ran the dynamic graph too
    return graph, values_a, values_b


@pytest.mark.slow
def test_a_dynamic_graph_knows_its_symbols_and_one_key_serves_the_family():
    graph, values_a, values_b = dynamic_graph()
    sizes = graph.sizes
    assert isinstance(sizes, SymbolicSizes) and len(sizes.symbols) == 2
    assert sorted(sizes.binding(values_a).values()) == [3, 24] and sorted(sizes.binding(values_b).values()) == [4, 9]
    from sublinear.runtime.graph import value_key as _value_key

    assert _value_key(values_a, None, sizes) == _value_key(values_b, None, sizes)
    assert _value_key(values_a) != _value_key(values_b)
    assert {dims for symbol in sizes.symbols for dims in argument_dims(sizes.sources[symbol], ["ids"])} == {
        ("ids", 0), ("ids", 1)}


@pytest.mark.slow
def test_stand_ins_and_symbolic_inputs_are_at_the_bound():
    graph, values, _ = dynamic_graph()
    sizes = graph.sizes
    bound = {name: 8 * (k + 1) for k, name in enumerate(sizes.symbols)}  # 8 and 16
    stand_ins = sizes.stand_ins(values, bound)
    ids = next(k for k, spec in enumerate(sizes.inputs) if spec is not None and not isinstance(spec, str))
    assert sorted(stand_ins[ids].shape) == [8, 16] and stand_ins[ids].dtype == torch.int64
    assert all(v is values[k] for k, v in enumerate(stand_ins) if sizes.inputs[k] is None)
    symbolic, renamed = sizes.symbolic_inputs(values, bound)
    assert all(isinstance(s, torch.SymInt) for s in symbolic[ids].shape)
    assert sorted(renamed.values()) == sorted(sizes.symbols)
    assert sorted(int(s.node.hint) for s in symbolic[ids].shape) == [8, 16]


def test_a_static_graph_has_no_symbolic_sizes():
    model = TinyTransformer()
    keep = _Keep()
    with receiving(keep):
        compile_entry(model, "TinyTransformer", dynamic=False)(token_batches([(2, 16)])[0])
    assert keep.graphs[0][0].sizes is None


# ---------------------------------------------------------------------------------------------------------------
# Training over changing shapes


@pytest.mark.slow
def test_seven_batch_and_length_shapes_plan_at_most_three_times_and_train_like_eager(caplog):
    torch.manual_seed(0)
    base = TinyTransformer()
    batches = token_batches(SHAPES)
    eager = train_over(copy.deepcopy(base), batches)
    with caplog.at_level(logging.INFO, logger="sublinear"):
        compiled = sublinear.compile(copy.deepcopy(base), config=PLAIN)
        planned = train_over(compiled, batches)
    assert len(plans_made(caplog)) <= 3, plans_made(caplog)
    assert_same_training(eager, planned)
    assert "planned for" in str(compiled.sublinear_plan)  # the latest call ran a dynamic graph's plan


@pytest.mark.slow
def test_slices_bounded_by_a_dynamic_size_train_like_eager_on_the_eager_executor():
    """A dynamic graph's slice bounds are its size nodes (BERT's positions[:length]); the inductor case is below."""
    torch.manual_seed(0)
    base = TinyTransformer(positions=32)
    batches = token_batches([(2, 12), (2, 30), (2, 17)])
    compiled = sublinear.compile(copy.deepcopy(base), config=dataclasses.replace(PLAIN, compiler="eager"))
    planned = train_over(compiled, batches)
    assert "planned for" in str(compiled.sublinear_plan)  # the slice's bound was a symbolic size
    assert_same_training(train_over(copy.deepcopy(base), batches), planned)


@pytest.mark.slow
def test_shapes_within_the_bound_reuse_the_plan_and_a_larger_one_plans_again(caplog):
    torch.manual_seed(0)
    compiled = sublinear.compile(TinyTransformer(), config=PLAIN)
    with caplog.at_level(logging.INFO, logger="sublinear"):
        for ids in token_batches([(2, 16), (2, 24), (2, 9), (2, 30), (2, 17)]):
            compiled(ids).backward()
        # The static first graph, then the dynamic one for lengths up to 32 (one when TorchDynamo already made the
        # length dynamic for this forward earlier in the process).
        assert len(plans_made(caplog)) <= 2
        caplog.clear()
        compiled(token_batches([(2, 40)])[0]).backward()
    assert "beyond those its plan was made for" in caplog.text and "<=64" in str(compiled.sublinear_plan)
    assert len(plans_made(caplog)) <= 1  # searched again, or the plan kept where it still meets the objective


@pytest.mark.slow
def test_a_budget_plan_holds_its_budget_at_every_shape_it_serves():
    torch.manual_seed(0)
    base = TinyTransformer(width=64)
    batches = token_batches([(4, 16), (4, 40), (4, 23), (4, 64), (4, 9), (4, 33)])
    compiled = sublinear.compile(copy.deepcopy(base), config=PLAIN)
    for ids in batches[:2]:
        compiled(ids).backward()
    family = compiled.sublinear_plan.graphs[0]
    budget = (family.predicted_peak_bytes + family.baseline_peak_bytes) // 2  # between the lowest plan and eager
    config = dataclasses.replace(PLAIN, memory_budget=budget, max_time_ratio=10.0)
    compiled = sublinear.compile(copy.deepcopy(base), config=config)

    def step(model, ids):
        model(ids).backward()

    assert measure(step, copy.deepcopy(base), batches[3]).peak_bytes > budget  # eager does not fit at length 64
    for ids in batches:
        peak = measure(step, compiled, ids).peak_bytes
        assert peak <= budget, (tuple(ids.shape), peak, budget)
    assert "planned for" in str(compiled.sublinear_plan)


@pytest.mark.parametrize("ahead", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first-call", "planned-ahead"])
@pytest.mark.slow
def test_max_sizes_make_one_plan_serve_every_smaller_shape(ahead, caplog):
    torch.manual_seed(0)
    base = TinyTransformer()
    batches = token_batches(SHAPES)
    config = dataclasses.replace(PLAIN, max_sizes={"ids": (8, 32)})
    with caplog.at_level(logging.INFO, logger="sublinear"):
        largest = (torch.zeros(8, 32, dtype=torch.long),) if ahead else None
        compiled = sublinear.compile(copy.deepcopy(base), largest, config=config)
        planned = train_over(compiled, batches)
    assert len(plans_made(caplog)) == 1, plans_made(caplog)
    assert "planned for s0<=8, s1<=32" in str(compiled.sublinear_plan)
    assert_same_training(train_over(copy.deepcopy(base), batches), planned)


@pytest.mark.slow
def test_inductor_compiles_a_family_once_and_trains_like_torch_compile(caplog):
    from sublinear.execute.compiled import CompiledGraph

    torch.manual_seed(0)
    base = TinyTransformer(positions=32)
    batches = token_batches([(2, 16), (3, 24), (4, 9), (2, 31), (3, 20)])
    config = dataclasses.replace(PLAIN, compiler="inductor")
    with caplog.at_level(logging.INFO, logger="sublinear"):
        compiled = sublinear.compile(copy.deepcopy(base), config=config)
        losses, grads, _, rng = train_over(compiled, batches)
    assert len(plans_made(caplog)) == 2 and "does not serve" not in caplog.text
    family = next(iter(compiled.sublinear_backend.latest.values()))
    assert isinstance(family.rewritten, CompiledGraph) and family.rewritten.partitioner.applied
    assert family.bound and family.rewritten.peak_bytes is not None
    ref_losses, ref_grads, _, ref_rng = train_over(torch.compile(copy.deepcopy(base)), batches)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    ref_grads = {k.removeprefix("_orig_mod."): v for k, v in ref_grads.items()}
    assert grads.keys() == ref_grads.keys()
    assert all(torch.allclose(grads[k], ref_grads[k], rtol=1e-3, atol=1e-5) for k in grads)
    assert torch.equal(rng, ref_rng)



class _CountingNet(nn.Module):
    """A custom autograd.Function, dropout and a Python side effect (a call counter) in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop, self.calls = nn.Linear(16, 16), nn.Linear(16, 16), nn.Dropout(0.1), 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.drop(Square.apply(self.a(x)))).sum()


@pytest.mark.slow  # inductor compiles for sublinear and for torch.compile's reference
def test_torch_compile_around_apply_trains_over_changing_batch_sizes_like_torch_compile():
    """The outer compile breaks its graph at the planned module; the planned graph becomes dynamic at the second
    batch size, and each of its symbols is sized as the shape environment hinted it, scalar inputs included."""
    torch.manual_seed(0)
    base = _CountingNet()
    batches = [torch.randn(4 + k, 16, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def run(model, module):
        torch.manual_seed(2)
        grads = []
        for x in batches:
            model(x).backward()
            grads.append([p.grad.clone() for p in module.parameters()])
            module.zero_grad()
        return grads, torch.get_rng_state()

    planned = sublinear.apply(copy.deepcopy(base), dataclasses.replace(PLAIN, compiler="inductor"))
    grads, rng = run(torch.compile(planned), planned)
    reference = copy.deepcopy(base)
    ref_grads, ref_rng = run(torch.compile(reference), reference)
    assert planned.sublinear_plan is not None and planned.calls == reference.calls == len(batches)
    assert all(torch.allclose(a, b, atol=1e-5) for got, ref in zip(grads, ref_grads) for a, b in zip(got, ref))
    assert torch.equal(rng, ref_rng)


def _laid_out(layout: str, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf, and an activation made from it (not a leaf) of ``rows`` rows laid out as ``layout``."""
    g = torch.Generator().manual_seed(seed)
    if layout in ("channels_last", "nchw"):
        leaf = torch.randn(rows, 3, 8, 8, generator=g).requires_grad_()
        form = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        return leaf, (leaf * 1).contiguous(memory_format=form)
    shape = {"slice": (rows, 64), "transpose": (32, rows), "expand": (1, 32), "offset": (rows + 1, 32)}
    leaf = torch.randn(*shape.get(layout, (rows, 32)), generator=g).requires_grad_()
    x = leaf * 1
    views = {"slice": lambda: x[:, :32], "transpose": lambda: x.t(), "expand": lambda: x.expand(rows, 32),
             "offset": lambda: x[1:]}
    return leaf, views.get(layout, lambda: x)()


def _gradients_over_layouts(model: nn.Module, layout: str) -> list[list[torch.Tensor]]:
    """The input's and parameters' gradients of steps that alternate a dense input with ``layout`` over changing
    row counts (TorchDynamo makes the graph dynamic, strides included, at the second call)."""
    dense = "nchw" if layout == "channels_last" else "dense"
    grads = []
    for seed, (form, rows) in enumerate([(dense, 8), (layout, 12), (layout, 20), (dense, 16), (layout, 12)]):
        leaf, x = _laid_out(form, rows, seed)
        model(x).square().mean().backward()
        grads.append([leaf.grad, *(p.grad for p in model.parameters())])
        model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("layout", ["expand", pytest.param("slice", marks=pytest.mark.slow),
                                    pytest.param("transpose", marks=pytest.mark.slow),
                                    pytest.param("offset", marks=pytest.mark.slow),
                                    pytest.param("channels_last", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_inputs_laid_out_unlike_the_first_call_train_like_eager(layout, compiler):
    """Code compiled for a family asserts its inputs' strides: a stand-in for an input with gaps or overlaps
    between its elements (a slice of a wider tensor, an expanded one) keeps them (a clone made it dense)."""
    torch.manual_seed(0)
    if layout == "channels_last":
        base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 4, 3))
    else:
        base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    reference = _gradients_over_layouts(copy.deepcopy(base), layout)
    planned = sublinear.compile(copy.deepcopy(base), config=dataclasses.replace(PLAIN, compiler=compiler))
    for got, expected in zip(_gradients_over_layouts(planned, layout), reference):
        for a, b in zip(got, expected):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) if compiler == "inductor" else torch.equal(a, b)
