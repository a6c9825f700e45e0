"""compile(), apply(), the backend and the @sublinear.trace decorator on the patterns users bring: custom
autograd.Functions, state stored on modules, attribute and forward changes, optional arguments, dict outputs,
graph breaks, torch.compile around a compiled module, pickling."""

import copy
import dataclasses
import gc
import io
import logging
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sublinear
from sublinear.core import Plan
from sublinear.planners import make_plan
from sublinear.models import get_model

from conftest import PLAIN, Chain, LossAndWideOutput, ResidualNet, assert_same_training, profile_of, train_steps


def _eager_losses(model, batches, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    losses = []
    for data, label in batches[:steps]:
        loss = F.cross_entropy(model(data), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _batches(n, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def _every_op(compiled):
    """Make ``compiled`` (planned for one graph) recompute everything it can: one block per op."""
    compiled.use(Plan.every_op(compiled.sublinear_profile.num_ops))
    return compiled


# ---------------------------------------------------------------------------------------------------------------
# Silent failures of the symbolic_trace capture, each a regression test


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = GradientReversal.apply(self.b(h), 0.5)
        return self.c(StraightThroughRound.apply(h * 4) / 4)


def test_custom_autograd_functions_keep_their_backward():
    torch.manual_seed(0)
    base = WithFunctions()
    x = torch.randn(6, 8)
    eager = train_steps(copy.deepcopy(base), (x,), steps=2)
    compiled = _every_op(sublinear.compile(copy.deepcopy(base), (x,), config=PLAIN))
    assert_same_training(eager, train_steps(compiled, (x,), steps=2))
    # The reversed gradient really is reversed: b's gradient has the opposite sign of a plain layer's.
    plain = copy.deepcopy(base)
    plain.forward = lambda x: plain.c(torch.round(plain.b(torch.tanh(plain.a(x))) * 4) / 4)
    assert not torch.equal(eager[1]["b.weight"], train_steps(plain, (x,), steps=2)[1]["b.weight"])


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.calls = 0
        self.history = []

    def forward(self, x):
        self.calls += 1
        probs = torch.softmax(self.gate(x), dim=-1)
        self.aux_loss = (probs.mean(0) ** 2).sum() * 4  # the MoE load-balancing pattern
        self.history.append(x.shape[0])
        return probs


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        probs = self.router(x)
        out = sum(probs[:, i:i + 1] * self.drop(torch.relu(e(x))) for i, e in enumerate(self.experts))
        return out.sum(-1)


@pytest.mark.slow
def test_auxiliary_loss_counters_and_lists_stored_in_forward_behave_as_in_eager():
    torch.manual_seed(0)
    base = MoE().train()
    x = torch.randn(16, 8)

    def run(model, steps=2):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(0)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = model(x).pow(2).mean() + 0.1 * router_of(model).aux_loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, {k: p.detach().clone() for k, p in model.named_parameters()}

    def router_of(model):
        return getattr(model, "original_module", model).router

    eager_model, planned = copy.deepcopy(base), copy.deepcopy(base)
    compiled = _every_op(sublinear.compile(planned, (x,), config=PLAIN))
    (losses_a, params_a), (losses_b, params_b) = run(eager_model), run(compiled)
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    assert isinstance(planned.router.aux_loss, torch.Tensor) and planned.router.aux_loss.grad_fn is not None
    assert planned.router.calls == eager_model.router.calls == 2  # the planning dry run touched nothing
    assert planned.router.history == [16, 16]


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 1.0
        self.activation = "gelu"

    def forward(self, x):
        act = F.gelu if self.activation == "gelu" else torch.tanh
        return act(self.lin(x) * self.scale)


def test_attribute_and_forward_changes_after_compile_are_seen():
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    for change in (lambda m: setattr(m, "scale", 3.0), lambda m: setattr(m, "activation", "tanh"),
                   lambda m: setattr(m, "forward", lambda x: m.lin(x).sin())):
        change(model)
        out = compiled(x)
        expected = model(x)
        assert torch.equal(out, expected)


class SetsItsConfigOnFirstCall(nn.Module):
    """Like Hugging Face's classification heads: the first forward writes a config field that forward reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.problem_type = None

    def forward(self, x):
        if self.problem_type is None:
            self.problem_type = "regression"
        return self.lin(x).relu()


def test_plan_describes_the_latest_call_once_per_graph_after_a_recompile():
    model = SetsItsConfigOnFirstCall()
    x = torch.randn(4, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    for _ in range(3):
        compiled(x).sum().backward()
    assert model.problem_type == "regression"
    plan = compiled.sublinear_plan
    assert [g.graph for g in plan.graphs] == [0]  # TorchDynamo captured it again after the write: still one graph


@pytest.mark.slow
def test_plan_is_keyed_on_parameter_shapes_and_a_hit_is_checked_against_the_budget(tmp_path):
    x = torch.randn(64, 32)
    config = sublinear.SublinearMemoryConfig(memory_budget=None, max_time_ratio=math.inf, min_memory_per_time=0,
                                             cost_model="estimate", cache_dir=str(tmp_path))
    narrow = sublinear.compile(Chain(12, 32), (x,), config=config).sublinear_plan
    wide = sublinear.compile(Chain(12, 32), (x,), config=config)
    assert wide.sublinear_plan.from_cache  # same graph, same shapes: the stored plan
    wide_model = Chain(12, 32)
    wide_model.layers[5] = nn.Linear(32, 32, bias=False)  # another graph: a miss
    assert not sublinear.compile(wide_model, (x,), config=config).sublinear_plan.from_cache
    tight = sublinear.SublinearMemoryConfig(**{**config.__dict__, "memory_budget": narrow.predicted_peak_bytes - 1})
    with pytest.raises(sublinear.BudgetError):
        sublinear.compile(Chain(12, 32), (x,), config=tight)
    grown = sublinear.compile(Chain(12, 256), (torch.randn(64, 256),), config=config).sublinear_plan
    assert not grown.from_cache and grown.predicted_peak_bytes > narrow.predicted_peak_bytes


def test_optional_tensor_given_at_call_time_only_and_the_other_way_round():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, mask=None, *, temperature=1.0):
            h = self.lin(x) / temperature
            if mask is not None:
                h = h.masked_fill(~mask, 0.0)
            return torch.relu(h)

    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.3
    without = sublinear.compile(copy.deepcopy(model), (x,), config=PLAIN)
    assert torch.equal(without(x, mask), model(x, mask))
    with_mask = sublinear.compile(copy.deepcopy(model), (x, mask), config=PLAIN)
    assert torch.equal(with_mask(x, temperature=2.0), model(x, temperature=2.0))
    assert len(with_mask.sublinear_plan.graphs) == 1


def test_dict_and_model_output_results_can_be_mutated_like_eager():
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    @dataclass
    class Out(ModelOutput):
        logits: torch.Tensor = None
        hidden: torch.Tensor = None

    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, **kwargs):
            h = self.lin(x)
            return {"dict": {"h": h, "n": kwargs.get("n", 0)}, "out": Out(logits=h.sum(-1), hidden=h)}

    model = DictModel()
    x = torch.randn(3, 8)
    compiled = sublinear.compile(model, (x,), {"n": 2}, config=PLAIN)
    result = compiled(x, n=2)
    assert result["dict"]["n"] == 2 and isinstance(result["out"], Out)
    result["out"].logits = None  # ModelOutput stays mutable
    result["dict"]["extra"] = 1
    result["out"].hidden.sum().backward()
    assert model.lin.weight.grad is not None


class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum().item() > 0:  # data-dependent: TorchDynamo breaks the graph here
            h = h * 2
        return self.b(h)


def test_graph_breaks_are_planned_per_graph_and_reported_once(caplog):
    torch.manual_seed(0)
    model = Breaks()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="sublinear"):
        compiled = sublinear.compile(copy.deepcopy(model), (x,), config=PLAIN)  # needs data: planned at the call
        assert compiled.sublinear_plan is None
        assert any(r.levelno == logging.WARNING and "cannot plan Breaks ahead" in r.getMessage()
                   for r in caplog.records)  # never a silent None
        out = compiled(x)
        compiled(x)
    # the break is warned of once; planning that outlasts the progress threshold also says "graph break" at INFO
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "graph break" in r.getMessage()]
    assert len(warnings) == 1 and "test_api.py" in warnings[0] and "2 graphs" in warnings[0]
    plan = compiled.sublinear_plan
    assert len(plan.graphs) == 2 and plan.breaks and "test_api.py" in str(plan)
    assert torch.equal(out, model(x))


def _gated(expert: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if expert.weight.sum().item() > -1e9:  # data-dependent: a break at each call
        return h + torch.relu(expert(h))
    return h


class RepeatedBreaks(nn.Module):
    """The same break reached three times (a graph per expert) and a second break of another kind."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = _gated(self.experts[0], x)
        h = _gated(self.experts[1], h)
        h = _gated(self.experts[2], h)
        print(end="")  # a break of another kind
        return h.sum()


def test_graph_break_reports_agree_and_name_every_reason(caplog):
    compiled = sublinear.compile(RepeatedBreaks(), config=PLAIN)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        for _ in range(2):
            compiled(torch.randn(4, 8)).backward()
    warnings = [r.getMessage() for r in caplog.records if "graph break" in r.getMessage()]
    plan = compiled.sublinear_plan
    assert len(warnings) == 1 and len(plan.breaks) == 2
    assert f"into {len(plan.graphs)} graphs" in warnings[0] and "at 2 graph break(s)" in warnings[0]
    assert plan.runs > len(plan.graphs) and f"{len(plan.graphs)} graph(s) ({plan.runs} graph runs)" in plan.headline
    assert "Tensor.item()" in warnings[0] and "print" in warnings[0]  # every reason, one line each
    assert all(str(b) in warnings[0] for b in plan.breaks)


def test_torch_compile_around_a_compiled_module_runs_the_plan(monkeypatch):
    torch.manual_seed(0)
    base = Chain(6, 16)
    x = torch.randn(8, 16)
    eager = train_steps(copy.deepcopy(base), (x,), steps=2)
    inner = sublinear.compile(copy.deepcopy(base), (x,), config=PLAIN)
    inner.use(Plan.every_op(inner.sublinear_profile.num_ops))
    ran = []
    run_graph = inner.sublinear_backend.run_graph
    monkeypatch.setattr(inner.sublinear_backend, "run_graph", lambda *a: ran.append(1) or run_graph(*a))
    outer = torch.compile(inner, backend="eager")
    losses_b, _, _, _ = train_steps(outer, (x,), steps=2)
    grads_b = {k: p.grad for k, p in inner.named_parameters()}
    losses_a, grads_a, state_a, _ = eager
    assert len(ran) == 2  # both training calls ran the planned graph
    assert inner.sublinear_plan.num_blocks == inner.sublinear_profile.num_ops
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_an_error_of_the_forward_itself_is_raised_as_eager_raises_it():
    class Broken(nn.Module):
        def forward(self, x):
            return x + undefined_name  # noqa: F821

    with pytest.raises(NameError, match="undefined_name"):
        sublinear.compile(Broken(), (torch.randn(2),), config=PLAIN)
    with pytest.raises(NameError, match="undefined_name"):
        sublinear.compile(Broken(), config=PLAIN)(torch.randn(2))


# ---------------------------------------------------------------------------------------------------------------
# compile, apply, trace


@pytest.mark.slow
def test_decorator_trains_exactly_like_eager_and_leaves_the_module_alone():
    spec = get_model("tiny-resnet")
    torch.manual_seed(0)
    base = spec.build().train()
    batches = _batches(3)
    expected = _eager_losses(copy.deepcopy(base), batches, 3)

    net = copy.deepcopy(base)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def train_func(data, label, *, net, optimizer):
        loss = F.cross_entropy(net(data), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    torch.manual_seed(0)
    losses = [train_func(data, label, net=net, optimizer=optimizer).detach() for data, label in batches]
    assert all(torch.equal(a, b) for a, b in zip(expected, losses))
    assert type(net) is type(base) and "forward" not in net.__dict__
    compiled = train_func.sublinear_modules[net]
    assert compiled.sublinear_plan.num_blocks > 1
    assert list(compiled.state_dict()) == list(net.state_dict())


class LightningStyle(nn.Module):
    """A LightningModule's shape: the network is an attribute and training_step is a method."""

    def __init__(self):
        super().__init__()
        self.net = ResidualNet()

    def forward(self, x):
        return self.net(x)

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def training_step_via_self(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("method", ["training_step", "training_step_via_self"])
@pytest.mark.slow
def test_decorated_method_plans_the_modules_reached_through_self(method, caplog):
    torch.manual_seed(0)
    module = LightningStyle()
    reference = copy.deepcopy(module)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    with caplog.at_level(logging.INFO, logger="sublinear"):
        torch.manual_seed(0)
        getattr(module, method)(batch).backward()
    assert "planning self.net (ResNet" in caplog.text or "planning self.net (ResidualNet)" in caplog.text
    compiled = getattr(LightningStyle, method).sublinear_modules[module.net]
    assert compiled.sublinear_plan is not None
    assert type(module.net) is ResidualNet  # restored after the call
    torch.manual_seed(0)
    F.cross_entropy(reference(batch[0]), batch[1]).backward()
    for (name, a), b in zip(reference.named_parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_decorator_plans_modules_inside_lists_and_dicts():
    models = {"a": Chain(4, 8), "b": Chain(3, 8)}

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def step(nets, x):
        return sum(net(x).sum() for net in nets.values())

    step(models, torch.randn(2, 8)).backward()
    assert set(step.sublinear_modules) == set(models.values())
    assert all(step.sublinear_modules[m].sublinear_plan is not None for m in models.values())


def test_bare_form_and_call_form_and_pass_through():
    calls = []

    @sublinear.trace
    def f(x, scale, model):
        calls.append(type(model).__name__)
        if scale < 0:
            raise ValueError("negative scale")
        return model(x).sum() * scale, "extra"

    lin = nn.Linear(4, 4)
    out, extra = f(torch.randn(2, 4), 2.0, lin)
    assert extra == "extra" and calls == ["SublinearModule"]
    with pytest.raises(ValueError, match="negative scale"):
        f(torch.randn(2, 4), -1.0, lin)
    g = sublinear.trace(lambda m, x: m(x), sublinear_memory_config=sublinear.SublinearMemoryConfig(seed=3))
    assert g(lin, torch.randn(2, 4)).shape == (2, 4)


@pytest.mark.slow
def test_apply_plans_in_place_and_keeps_class_state_dict_and_optimizer():
    torch.manual_seed(0)
    base = ResidualNet()
    x = torch.randn(4, 3, 16, 16)  # at 8x8 a convolution backward's scratch on some CPUs outweighs what recompute saves
    eager = train_steps(copy.deepcopy(base), (x,), steps=2)
    model = copy.deepcopy(base)
    keys = list(model.state_dict())
    assert sublinear.apply(model, PLAIN, example_inputs=(x,)) is model
    assert type(model) is ResidualNet and list(model.state_dict()) == keys
    assert_same_training(eager, train_steps(model, (x,), steps=2))
    assert model.sublinear_plan.num_blocks > 1
    clone = pickle.loads(pickle.dumps(model))  # the planned forward pickles with the module
    assert clone(x).shape == (4, 5)
    sublinear.remove(model)
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="already"):
        sublinear.apply(sublinear.apply(model, PLAIN), PLAIN)


@pytest.mark.slow
def test_every_entry_point_has_the_plan_with_block_names_by_module_path(caplog):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    applied = sublinear.apply(ResidualNet(), PLAIN)
    assert applied.sublinear_plan is None  # nothing ran yet
    applied(x).sum().backward()
    compiled = sublinear.compile(ResidualNet(), (x,), config=PLAIN)
    backend = sublinear.backend(PLAIN)
    dynamo = torch.compile(ResidualNet(), backend=backend)
    dynamo(x).sum().backward()

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def step(model, x):
        model(x).sum().backward()

    assert step.sublinear_plan is None
    step(ResidualNet(), x)
    for plan in (applied.sublinear_plan, compiled.sublinear_plan, backend.sublinear_plan, step.sublinear_plan):
        text = plan.describe()
        assert "block 0: stem" in text and "__self__" not in text and "L[" not in text, text
    sublinear.remove(applied)
    assert "sublinear_plan" not in applied.__dict__

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def no_model(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="sublinear"):
        no_model(x)
    assert "no nn.Module among its arguments" in caplog.text and no_model.sublinear_plan is None


@pytest.mark.slow
def test_plan_says_which_layers_end_blocks_are_recomputed_or_kept_at_which_signature():
    torch.manual_seed(0)
    model = ResidualNet()
    compiled = sublinear.compile(model, (torch.randn(2, 3, 8, 8),), config=PLAIN)
    _every_op(compiled)
    compiled(torch.randn(2, 3, 8, 8)).sum().backward()
    text = compiled.sublinear_plan.describe()
    assert "(2, 3, 8, 8):float32@cpu" in text
    assert "blocks.0.c1 (conv2d_1)" in text and "recomputes" in text
    compiled(torch.randn(6, 3, 8, 8)).sum().backward()  # another batch: its own plan
    assert "(6, 3, 8, 8):float32@cpu" in str(compiled.sublinear_plan)


@pytest.mark.slow
def test_replans_when_the_signature_changes():
    model = ResidualNet()

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def step(model, x):
        model(x).sum().backward()

    step(model, torch.randn(2, 3, 8, 8))
    compiled = step.sublinear_modules[model]
    first = compiled.sublinear_plan.graphs[0]
    step(model, torch.randn(2, 3, 8, 8))
    assert compiled.sublinear_plan.graphs[0] == first  # same signature: no new plan
    step(model, torch.randn(6, 3, 8, 8))  # TorchDynamo captures a dynamic graph, planned for batches up to 8
    assert compiled.sublinear_plan.graphs[0].signature == "(6, 3, 8, 8):float32@cpu (a dynamic graph planned for " \
                                                          "s0<=8)" != first.signature



@pytest.mark.slow
def test_planning_collects_only_its_own_garbage_and_leaves_a_frozen_heap_frozen(monkeypatch):
    # A full collection over a long-running process's heap would land inside the planning's wall time.
    frozen_while_searching = []
    real_make_plan = sublinear.runtime.pipeline.make_plan

    def searching(*args, **kwargs):
        frozen_while_searching.append(gc.get_freeze_count())
        return real_make_plan(*args, **kwargs)
    monkeypatch.setattr(sublinear.runtime.pipeline, "make_plan", searching)
    x = torch.randn(2, 3, 8, 8)
    sublinear.compile(ResidualNet(), (x,), config=PLAIN)
    assert frozen_while_searching[-1] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # the user's own freeze stays
    try:
        frozen = gc.get_freeze_count()
        sublinear.compile(ResidualNet(), (torch.randn(3, 3, 8, 8),), config=PLAIN)
        assert len(frozen_while_searching) == 2 and gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


@pytest.fixture
def searches(monkeypatch) -> list[int]:
    """One entry per plan search (``make_plan`` call) from here on."""
    made = []
    real_make_plan = sublinear.runtime.pipeline.make_plan
    monkeypatch.setattr(sublinear.runtime.pipeline, "make_plan",
                        lambda *a, **k: made.append(1) or real_make_plan(*a, **k))
    return made


@pytest.mark.slow
def test_a_model_on_meta_planned_ahead_is_not_planned_again_at_its_first_step(searches):
    # Planning ahead captures a meta model on fake CPU tensors; the step's meta tensors must find that plan.
    with torch.device("meta"):
        model = ResidualNet()
        x = torch.randn(4, 3, 8, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    planned = compiled.sublinear_plan.graphs[0]
    assert len(searches) == 1 and planned.signature == "(4, 3, 8, 8):float32@meta"
    compiled(x).sum().backward()
    assert len(searches) == 1 and compiled.sublinear_plan.graphs[0].plan == planned.plan


@pytest.mark.slow
def test_an_applied_module_planned_ahead_under_a_budget_is_not_searched_again_at_its_first_call(searches):
    """Under a budget the first call plans on a data-less twin before running; ``apply`` runs the class's forward
    bound to the module, whose graph must be the twin's (same code), so the call runs that plan."""
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(4, 3, 8, 8)
    sublinear.apply(model, dataclasses.replace(PLAIN, memory_budget=1 << 40))
    model(x).sum().backward()
    assert len(searches) == 1


@pytest.mark.slow
def test_a_meta_model_is_planned_for_the_eager_executor_at_the_reference_gpu_rates(monkeypatch):
    # Captured on fake CPU tensors, a meta model is still planned as one: for the eager executor (nothing runs on
    # meta), its op times estimated for the reference GPU, not at this CPU's rates.
    monkeypatch.delenv("SUBLINEAR_COMPILER", raising=False)
    with torch.device("meta"):
        model = ResidualNet()
        x = torch.randn(4, 3, 8, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    assert "reference GPU" in compiled.sublinear_profile.cost_source
    assert compiled.sublinear_plan.graphs[0].signature == "(4, 3, 8, 8):float32@meta"
    assert "meta device" in compiled.sublinear_plan.graphs[0].executor


@pytest.mark.slow
def test_pareto_point_applies_in_one_call():
    torch.manual_seed(0)
    model = Chain(20, 32)
    x = torch.randn(256, 32)
    points = sublinear.pareto(model, (x,), config=PLAIN, budgets=3)
    point = points[len(points) // 2]
    compiled = sublinear.compile(model, (x,), config=PLAIN, plan=point)
    compiled(x).sum().backward()
    assert compiled.sublinear_plan.to_plan() == point.plan
    assert compiled.sublinear_plan.predicted_peak_bytes == point.peak_bytes
    other = points[0]
    compiled.use(other)
    compiled(x).sum().backward()
    assert compiled.sublinear_plan.to_plan() == other.plan


@pytest.mark.slow
def test_pickle_and_torch_save_keep_the_model_and_plan_again():
    torch.manual_seed(0)
    model = ResidualNet()
    x = torch.randn(2, 3, 8, 8)
    compiled = sublinear.compile(model, (x,), config=PLAIN)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, sublinear.SublinearModule) and loaded.config == PLAIN
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), compiled.state_dict().values()))
    loaded(x).sum().backward()
    assert loaded.sublinear_plan is not None
    assert isinstance(pickle.loads(pickle.dumps(compiled)), sublinear.SublinearModule)


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_decorator_inside_ddp_keeps_ddp_and_its_hooks(single_process_group):
    torch.manual_seed(0)
    base = ResidualNet()
    reference = copy.deepcopy(base)
    net = nn.parallel.DistributedDataParallel(base)
    x = torch.randn(4, 3, 8, 8)

    @sublinear.trace(sublinear_memory_config=PLAIN)
    def step(net, x):
        net(x).sum().backward()

    torch.manual_seed(1)
    step(net, x)
    assert isinstance(net.module, ResidualNet)  # restored after the call
    torch.manual_seed(1)
    reference(x).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), base.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


@pytest.mark.slow
def test_no_trainable_parameters():
    model = ResidualNet()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled = sublinear.compile(model, x, config=PLAIN)
    torch.manual_seed(0)
    compiled(x).sum().backward()
    reference_x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    model(reference_x).sum().backward()
    assert torch.equal(x.grad, reference_x.grad)
    out = compiled(torch.randn(2, 3, 8, 8))  # nothing requires grad: plain forward
    assert out.grad_fn is None


def test_other_dtype_and_device_work():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    compiled = sublinear.compile(model, torch.empty(4, 8, device="meta"), config=PLAIN)
    model.double()
    x = torch.randn(5, 8, dtype=torch.float64)
    compiled(x).sum().backward()
    model_grad = model[0].weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    assert model_grad.dtype == torch.float64 and torch.equal(model_grad, model[0].weight.grad)


def test_bad_config_and_arguments():
    with pytest.raises(TypeError, match="SublinearMemoryConfig"):
        sublinear.compile(nn.Linear(2, 2), torch.randn(1, 2), config={"thresh_nr_try": 3})
    with pytest.raises(TypeError, match="nn.Module"):
        sublinear.compile(lambda x: x, torch.randn(1, 2))
    with pytest.raises(TypeError, match="decorates a function"):
        sublinear.trace(3)
    with pytest.raises(TypeError, match="compile the plain module"):
        sublinear.compile(sublinear.compile(nn.Linear(2, 2), torch.randn(1, 2)), torch.randn(1, 2))
    with pytest.raises(ValueError, match="ParetoPoint"):
        compiled = sublinear.compile(Breaks(), config=PLAIN)
        compiled(torch.randn(2, 8))
        compiled.use(Plan.no_split(3))


def test_no_package_name_is_both_a_submodule_and_a_function():
    # Importing a submodule binds the package attribute of its name: a function exported under that name would be
    # replaced by the module.
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(sublinear.__path__)}
    assert not submodules & set(sublinear.__all__), submodules & set(sublinear.__all__)


def test_the_backend_factory_stays_callable_after_the_package_loaded_its_modules():
    import importlib

    importlib.import_module("sublinear.api")  # loads every submodule the user surface needs
    model = torch.compile(Chain(3, width=8), backend=sublinear.backend(PLAIN))
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert isinstance(sublinear.backend(PLAIN), sublinear.SublinearBackend)


class Counters(nn.Module):
    """Counts its calls in an int attribute and in a buffer, as step-dependent schedules do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        self.steps += 1
        return self.lin(x).tanh().pow(2).mean()


def test_counters_in_forward_are_kept_and_plan_once(caplog):
    torch.manual_seed(0)
    base = Counters()
    x = torch.randn(4, 16)
    eager = train_steps(copy.deepcopy(base), (x,), steps=20)
    model = copy.deepcopy(base)
    compiled = sublinear.compile(model, config=PLAIN)
    with caplog.at_level(logging.INFO, logger="sublinear"):
        planned = train_steps(compiled, (x,), steps=20)
    searches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sublinear: planned graph")]
    assert len(searches) <= 2, searches  # not one capture and plan per counter value
    assert model.calls == 20 and model.steps.item() == 20
    assert_same_training(eager, planned)


class TwoHalves(nn.Module):
    """Two deep halves split by a graph break that needs no tensor values (so the step can be planned ahead)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)))
        self.second = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)))

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h).pow(2).mean()


@pytest.mark.slow
def test_a_budget_holds_for_a_split_step_from_its_first_call():
    torch.manual_seed(0)
    base = TwoHalves()
    x = torch.randn(256, 64)
    unbudgeted = sublinear.compile(copy.deepcopy(base), config=PLAIN)
    unbudgeted(x).backward()
    free = unbudgeted.sublinear_plan
    assert len(free.graphs) == 2
    budget = (free.predicted_peak_bytes + free.baseline_peak_bytes) // 2
    budgeted = sublinear.compile(copy.deepcopy(base), config=dataclasses.replace(PLAIN, memory_budget=budget))

    def step(model, x):
        model(x).backward()

    first = sublinear.measure(step, budgeted, x).peak_bytes  # the first call: planned as one step before it runs
    plan = budgeted.sublinear_plan
    assert first <= budget and plan.predicted_peak_bytes <= budget, (first, plan.predicted_peak_bytes, budget)
    assert sublinear.measure(step, copy.deepcopy(base), x).peak_bytes > budget  # eager does not fit
    assert plan.baseline_peak_bytes == free.baseline_peak_bytes  # eager's peak, whatever the plans


class _LightThenHeavy(nn.Module):
    """A graph break between a narrow half and a wide one: the step's floor is the second graph's, beside what the
    first holds."""

    def __init__(self):
        super().__init__()
        self.light, self.heavy = (nn.Sequential(*(nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, 64))
                                                  for _ in range(3))) for width in (256, 512))

    def forward(self, x):
        h = self.light(x)
        torch._dynamo.graph_break()
        return self.heavy(h).square().mean()


@pytest.mark.parametrize("config", [PLAIN, pytest.param(dataclasses.replace(PLAIN, compiler="inductor"),
                                                        marks=pytest.mark.slow)], ids=["eager-executor", "inductor"])
def test_a_budget_below_a_split_steps_floor_is_refused_naming_the_steps_smallest_peak(config):
    """A refusal before any call finished names the first graph's smallest peak and says that later graphs may add to
    it. A budget above that but below what the call's parameters, inputs and gradients need whatever the plans is
    refused as soon as a graph's context shows it (here the second graph of the first call), naming the step's
    smallest peak, not run over at every call."""
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    with pytest.raises(sublinear.BudgetError) as first_graph:
        sublinear.apply(_LightThenHeavy(), dataclasses.replace(config, memory_budget=1))(x).backward()
    assert first_graph.value.later_graphs_unknown and "No call has finished yet" in str(first_graph.value)
    budget = first_graph.value.smallest + (16 << 10)  # above the first graph's floor, the only one the first call knows
    torch.manual_seed(0)
    run = sublinear.apply(_LightThenHeavy(), dataclasses.replace(config, memory_budget=budget))
    with pytest.raises(sublinear.BudgetError) as step:
        for _ in range(4):
            run(x).backward()
    assert step.value.smallest > budget and "whatever the plan" in str(step.value)

@pytest.mark.slow
def test_compile_with_a_budget_runs_exactly_and_within_it():
    spec = get_model("tiny-bert")
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(32, seq=64)
    eager = make_plan(profile_of(model, *args), PLAIN)
    budget = (eager.simulation.peak_bytes + eager.baseline.peak_bytes) // 2
    reference = copy.deepcopy(model)
    config = dataclasses.replace(PLAIN, memory_budget=budget)
    compiled = sublinear.compile(model, args, config=config)
    measured = sublinear.measure(sublinear.training.training_step, compiled, *args).peak_bytes
    assert compiled.sublinear_plan.predicted_peak_bytes <= budget
    assert abs(measured - compiled.sublinear_plan.predicted_peak_bytes) / measured < 0.03
    model.zero_grad(set_to_none=True)
    assert_same_training(train_steps(reference, args), train_steps(compiled, args))  # dropout replayed exactly


class _SometimesReadsItsSecondOutput(nn.Module):
    """Two graphs: the second reads the first's auxiliary output only on calls that ask for it (as an MoE's routing
    decides which expert graphs read what)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, with_aux: bool):
        h, aux = self.a(x).relu(), self.b(x).tanh()
        torch._dynamo.graph_break()
        out = self.c(h).sum()
        return out + aux.sum() if with_aux else out


def test_a_graph_whose_outputs_calls_use_differently_is_planned_for_the_most_demanding_use(caplog):
    torch.manual_seed(0)
    compiled = sublinear.compile(_SometimesReadsItsSecondOutput(), config=PLAIN)
    x = torch.randn(8, 16)
    plans = []
    with caplog.at_level(logging.INFO, logger="sublinear"):
        for call in range(8):
            caplog.clear()
            compiled(x, call % 2 == 1).backward()
            plans.append(sum(r.getMessage().startswith(("sublinear: planned graph", "sublinear: reused the plan"))
                             for r in caplog.records))
    # the first two calls capture a graph each and teach nothing of the first graph's outputs (see CallTracker.captures)
    assert sum(plans[5:]) == 0, plans  # settled: alternating calls no longer plan the first graph again
    first = next(v for v in compiled.sublinear_backend.latest.values() if len(v.uses) == 2)
    assert first.uses == ("passed", "passed")  # each read by the second graph on some call, let go before backward


@pytest.mark.parametrize("keeps", [False, True], ids=["dropped", "kept"])
@pytest.mark.slow
def test_a_budget_met_only_without_an_output_the_caller_drops_is_refused_only_once_a_call_shows_it_kept(keeps):
    """Before any call the outputs no loss reads are guessed held; a budget the lowest plan meets only without them
    is planned again once a call shows the caller dropping them (met), or refused once one shows it keeping them."""
    x = torch.randn(64, 32)

    def fresh():
        torch.manual_seed(0)
        return LossAndWideOutput().train()

    def step(m, inputs):
        loss, wide = m(inputs)
        if not keeps:
            del wide
        loss.backward()

    free, model = fresh(), fresh()
    run = sublinear.apply(free, PLAIN)  # no budget: the lowest peak
    run(x)[0].backward()
    held = free.sublinear_plan.predicted_peak_bytes  # planned with the wide output guessed held
    run(x)[0].backward()
    dropped = free.sublinear_plan.predicted_peak_bytes  # planned knowing the caller dropped it
    assert dropped < held
    budget = (dropped + held) // 2
    run = sublinear.apply(model, dataclasses.replace(PLAIN, memory_budget=budget))
    if keeps:
        with pytest.raises(sublinear.BudgetError):
            for _ in range(3):
                step(run, x)
        return
    for _ in range(3):
        step(run, x)
        model.zero_grad(set_to_none=True)
    assert model.sublinear_plan.predicted_peak_bytes <= budget
    assert sublinear.measure_cpu_allocator(step, run, x).peak_bytes <= budget
