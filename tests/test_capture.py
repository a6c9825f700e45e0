"""Capture: TorchDynamo graphs of the forward, taken on a data-less twin; what they hold and what capture says."""

import gc
import dataclasses
import logging
import re
import weakref

import pytest
import torch
from torch import nn

from sublinear.capture.dynamo import (BUFFER, INPUT, PARAMETER, CaptureError, NeedsData, _Dispatch, capture,
                               compile_entry, describe_node, graph_breaks, module_path, receiving)
import sublinear
from sublinear.execute.program import NodeProgram
from sublinear.profiling.graph import profile

from conftest import PLAIN


class ItemAssignment(nn.Module):
    """symbolic_trace cannot trace this: item assignment through a mask and a loop over x.shape[0]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        y = self.bn(self.lin(x))
        y[y < 0] = 0
        rows = []
        for i in range(x.shape[0]):
            rows.append(y[i] * (i + 1))
        return torch.stack(rows).sum(-1)


class DataDependent(nn.Module):
    """A branch on a tensor's value: TorchDynamo runs it eagerly between two graphs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        x = self.lin(x)
        if x.sum() > 0:
            return x * 2
        return x - 1


def _real_values(model, graph, inputs):
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    values = []
    for source in graph.sources:
        keys = re.findall(r"\['([^']+)'\]", source)
        values.append(inputs[keys[0]] if keys[0] != "self" else named[".".join(keys[1:])])
    return values


def test_graph_lifts_parameters_and_buffers_to_inputs_with_their_kinds():
    m = ItemAssignment()
    graph = capture(m, (torch.randn(3, 6),)).graph
    assert graph.kinds.count(PARAMETER) == 4 and graph.kinds.count(BUFFER) == 3 and graph.kinds.count(INPUT) == 1
    assert not [n for n in graph.graph_module.graph.nodes if n.op == "call_module"]
    x = torch.randn(5, 6)
    m.eval()
    expected = m(x)
    m.train()
    captured = capture(m, (x,)).graph  # a shape loop is unrolled: one graph per shape
    out = NodeProgram(captured.graph_module).run(_real_values(m, captured, {"args": x}))[0]
    assert out.shape == expected.shape


def test_capture_leaves_the_module_alone_and_values_are_fake():
    m = ItemAssignment()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    graph = capture(m, (torch.randn(4, 6),)).graph
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(isinstance(v, torch._subclasses.fake_tensor.FakeTensor) for v in graph.example_values)


class Printing(nn.Module):
    """A print is a graph break whose eager code needs no tensor values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        x = self.lin(x)
        print("between graphs")
        return x * 2


def test_graph_break_between_graphs_names_file_line_and_reason(capsys):
    captured = capture(Printing(), (torch.randn(2, 3),))
    assert len(captured.graphs) == 2
    (brk,) = captured.breaks
    assert re.search(r"test_capture.py:\d+$", brk.location) and "print" in brk.reason.lower()
    with pytest.raises(CaptureError, match="captured 2"):
        captured.graph


def test_eager_code_that_needs_tensor_values_cannot_be_captured_without_data():
    with pytest.raises(NeedsData, match=r"test_capture.py:\d+ needs tensor values .*first training call"):
        capture(DataDependent(), (torch.randn(2, 3),))


def test_meta_example_inputs_stand_for_the_modules_device():
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + torch.arange(x.shape[-1], device=x.device)

    graph = capture(Positions(), (torch.empty(2, 4, device="meta"),)).graph
    assert all(v.device.type == "cpu" for v in graph.example_values if isinstance(v, torch.Tensor))


def test_nodes_are_described_by_module_path_and_source_line():
    graph = capture(ItemAssignment(), (torch.randn(2, 6),)).graph
    linear = next(n for n in graph.graph_module.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    assert re.fullmatch(r"lin \(linear\) at .*test_capture.py:\d+", describe_node(linear))


def test_a_submodule_a_wrapper_reaches_through_its_dict_is_named_by_its_path():
    """peft's wrappers forward attribute reads to the model they wrap: TorchDynamo names its modules through
    ``__dict__['_modules']``."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_model = nn.Sequential(nn.Linear(4, 4))

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.base_model, name)

        def forward(self, x):
            return self.base_model(x)

    graph = capture(Wrapper(), (torch.randn(2, 4),)).graph
    linear = next(n for n in graph.graph_module.graph.nodes if n.op == "call_function")
    assert module_path(linear) == "base_model.0"


def test_code_is_the_same_for_fake_and_real_captures():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    fake = capture(m, (torch.randn(2, 3),)).graph
    real_graphs = []

    class Collect:
        def run_graph(self, shared, values):
            real_graphs.append(shared.graph)
            return shared.graph.graph_module(*values)

    with receiving(Collect()):
        compile_entry(m, "Sequential", dynamic=None)(torch.randn(2, 3))
    assert fake.code == real_graphs[0].code
    assert fake.graph_module.code != real_graphs[0].graph_module.code  # only the annotations differ


def test_errors_in_forward_are_the_forwards_own_with_its_file_and_line():
    import traceback

    class Typo(nn.Module):
        def forward(self, x):
            return x.no_such_method()

    with pytest.raises(AttributeError, match="no_such_method") as info:
        capture(Typo(), (torch.randn(2),))
    assert "return x.no_such_method()" in "".join(traceback.format_exception(info.value))


def test_graph_breaks_collector_is_silent_and_restores_logging(caplog):
    with caplog.at_level(logging.DEBUG):
        with graph_breaks() as breaks:
            torch.compile(DataDependent(), backend="eager")(torch.randn(2, 3))
    assert len(breaks) == 1
    assert not any("Graph break in user code" in r.getMessage() for r in caplog.records)
    logger = torch._logging.getArtifactLogger("torch._dynamo.symbolic_convert", "graph_breaks")
    assert not any(type(h).__name__ == "_Collect" for h in logger.handlers)


def test_a_forward_without_ops_does_not_stop_later_captures():
    # torch.compile enters every torch.nn module through one shared wrapper frame; a forward with no tensor ops
    # makes TorchDynamo skip that frame, which must not leave later torch.nn models uncaptured.
    x = torch.randn(4, 8)
    assert capture(nn.Identity(), (x,)).graphs == []
    assert len(capture(nn.Linear(8, 8), (x,)).graphs) == 1
    assert len(capture(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (x,)).graphs) == 1


@pytest.mark.slow
def test_graphs_of_a_dropped_compiled_model_are_freed(monkeypatch):
    # TorchDynamo maps each compiled code to its source code strongly, so a dropped entry's cache (every graph
    # captured through it) would stay alive: a max-batch search compiles dozens of times in one process.
    captured = weakref.WeakSet()
    real_backend = _Dispatch.__call__

    def recording(self, gm, example_inputs):
        captured.add(gm)
        return real_backend(self, gm, example_inputs)
    monkeypatch.setattr(_Dispatch, "__call__", recording)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)  # planned ahead on a capture, then a real call
    compiled(x).sum().backward()
    assert len(captured) >= 2
    del model, compiled
    for _ in range(3):  # the entry's collection clears the cache, the next one frees the graphs
        gc.collect()
    assert len(captured) == 0


class GrowingCache(nn.Module):
    """Like Hugging Face's DynamicCache: forward starts a tensor from a constant and concatenates onto it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        keys = torch.tensor([], dtype=h.dtype, device=h.device)
        return torch.cat([keys, h.flatten()]).sum()


def test_a_model_on_the_meta_device_is_captured_and_planned_as_meta():
    with torch.device("meta"):
        model = GrowingCache()
    x = torch.empty(3, 4, device="meta")
    graph = capture(model, (x,)).graph
    assert graph.model_device == "meta"
    p = profile(graph)
    assert p.cost_source.startswith("estimated") and p.measured_peak_bytes > 0
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    assert "(3, 4):float32@meta" in str(compiled.sublinear_plan)


def test_a_tensor_made_from_data_on_meta_in_a_call_is_refused_with_what_to_turn_off(caplog):
    """Planning ahead captures a meta model on CPU stand-ins; a training call on meta tensors runs TorchDynamo on
    them, where torch.tensor(..., device="meta") escapes its fake tensors: the call runs eagerly and says why."""
    with torch.device("meta"):
        model = GrowingCache()
    compiled = sublinear.compile(model, config=PLAIN)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        out = compiled(torch.empty(3, 4, device="meta"))
    assert out.device.type == "meta" and compiled.sublinear_plan is None
    assert "on the meta device" in caplog.text and "use_cache = False" in caplog.text


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.conv(x)
        return self.fc(h.mean((2, 3)))


def _raised(call):
    """The exception ``call()`` raises and its printed traceback."""
    import traceback

    with pytest.raises(Exception) as info:
        call()
    return info.value, "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("ahead", [False, True], ids=["first-call", "example-inputs"])
@pytest.mark.parametrize("wrong", ["channels", "dtype"])
def test_a_model_error_is_raised_as_eager_raises_it(wrong, ahead):
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(2, 4, 8, 8) if wrong == "channels" else torch.randn(2, 3, 8, 8, dtype=torch.float64)
    eager, _ = _raised(lambda: model(x))
    if ahead:
        error, text = _raised(lambda: sublinear.compile(TwoLayers(), (x,), config=PLAIN))
    else:
        compiled = sublinear.compile(TwoLayers(), config=PLAIN)
        error, text = _raised(lambda: compiled(x))
    assert type(error) is type(eager) and str(error) == str(eager)
    assert "test_capture.py" in text and "h = self.conv(x)" in text  # the user's frame
    assert len(text.splitlines()) <= 30 and "torch/_dynamo" not in text and "fake_tensor" not in text, text
    assert error.__cause__ is None and error.__suppress_context__


def test_a_call_torchdynamo_cannot_capture_runs_eagerly_and_says_so(monkeypatch, caplog):
    import sublinear.runtime.modules as runtime

    attempts = []

    def failing_entry(module, name, dynamic):
        def entry(*args, **kwargs):
            attempts.append(1)
            raise torch._dynamo.exc.Unsupported("a construct TorchDynamo cannot trace")
        return entry

    monkeypatch.setattr(runtime, "compile_entry", failing_entry)
    torch.manual_seed(0)
    model = TwoLayers()
    compiled = sublinear.compile(model, config=PLAIN)
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        out = compiled(x)
        again = compiled(x)
    assert torch.equal(out, model(x)) and torch.equal(again, out)
    assert "run eagerly, unplanned" in caplog.text and "cannot trace" in caplog.text
    assert len(attempts) == 1  # the second call with these shapes goes straight to eager


class CheckpointedDropout(nn.Module):
    """A ``torch.utils.checkpoint`` region with dropout in it, as Hugging Face's gradient checkpointing makes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 1)

    def block(self, x):
        return torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.5, self.training)

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)).pow(2).mean()


def test_checkpoint_regions_are_inlined_and_recompute_with_the_forwards_random_numbers():
    from conftest import assert_same_training, train_steps

    torch.manual_seed(0)
    base = CheckpointedDropout()
    x = torch.randn(16, 32)
    graph = capture(base, (x,)).graph
    targets = {str(n.target) for n in graph.graph_module.graph.nodes}
    assert not any("tag_activation_checkpoint" in t for t in targets) and any("dropout" in t for t in targets)
    import copy

    eager = train_steps(copy.deepcopy(base), (x,), steps=2)
    compiled = sublinear.compile(copy.deepcopy(base), (x,), config=PLAIN)
    compiled.use(sublinear.Plan.every_op(compiled.sublinear_profile.num_ops))  # dropout's block is rebuilt
    assert_same_training(eager, train_steps(compiled, (x,), steps=2))


class InPlaceAfterBreak(nn.Module):
    """After a graph break the next graph writes in place into its input, an activation of the previous graph (it
    requires grad and is not a leaf), as Mixtral's router jitter does."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        h.mul_(2)
        return self.b(h.relu()).pow(2).mean()


def test_an_in_place_write_into_an_activation_after_a_break_trains_like_eager():
    import copy

    from conftest import assert_same_training, train_steps

    torch.manual_seed(0)
    base = InPlaceAfterBreak()
    x = torch.randn(8, 16)
    eager = train_steps(copy.deepcopy(base), (x,), steps=2)
    compiled = sublinear.compile(copy.deepcopy(base), config=PLAIN)
    assert_same_training(eager, train_steps(compiled, (x,), steps=2))
    assert len(compiled.sublinear_plan.graphs) == 2


class RandomlyMasked(nn.Module):
    """Masks a random half of its tokens in forward, drawing the noise with torch.rand (as ViT-MAE does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        noise = torch.rand(x.shape[0], x.shape[1])
        keep = noise.argsort(dim=1)[:, : x.shape[1] // 2]
        h = self.embed(x).gather(1, keep.unsqueeze(-1).expand(-1, -1, 16))
        return self.head(h.relu()).mean()


def test_capturing_a_data_less_twin_leaves_the_random_stream_as_it_was():
    """The twin's graph runs on fakes, but torch.rand (no tensor argument) makes a real tensor there: planning
    ahead under a budget drew from the user's generator, so the first step masked other tokens than eager."""
    import copy

    from conftest import assert_same_training, train_steps

    torch.manual_seed(0)
    model, x = RandomlyMasked(), torch.randn(4, 10, 8)
    before = torch.get_rng_state()
    capture(model, (x,))
    assert torch.equal(torch.get_rng_state(), before)
    budget = dataclasses.replace(PLAIN, memory_budget=10**9)  # a budget plans ahead on the twin at the first call
    planned = copy.deepcopy(model)
    assert_same_training(train_steps(copy.deepcopy(model), (x,)),
                         train_steps(sublinear.apply(planned, budget), (x,)))


def test_a_backward_node_traced_before_the_first_gradient_runs_where_backward_first_reads_it():
    """A pattern pass puts a backward's replacement (reading only forward values) among the forward's nodes; the
    partitioner, ordering backward as autograd runs it, computes it just before its first reader, not first."""
    from torch import fx

    from sublinear.capture.joint import JointGraph

    graph = fx.Graph()
    x, tangent = graph.placeholder("primals_1"), graph.placeholder("tangents_1")
    tangent.meta["partitioner_tag"] = "is_backward"
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    replacement = graph.call_function(torch.ops.aten.neg.default, (y,))
    first = graph.call_function(torch.ops.aten.mul.Tensor, (tangent, 2.0))
    second = graph.call_function(torch.ops.aten.mul.Tensor, (first, replacement))
    for node in (replacement, first, second):
        node.meta["partitioner_tag"] = "is_backward"
    graph.output([y, second])
    joint = JointGraph.of(fx.GraphModule(nn.Module(), graph), num_fwd_outputs=1)
    assert joint.forward == [y]
    assert joint.backward == [first, replacement, second]
