"""The max-batch search finds the exact largest batch within the budget in few steps; hand-written baselines edit a
model once, are left out (with a note) where they do not apply, and transformers models get their own gradient
checkpointing as a row."""

import bisect

import pytest
import torch
from torch import nn

from sublinear.tools.baselines import (BASELINES, NotApplicable, _Checkpointed, checkpoint_blocks,
                                 hf_gradient_checkpointing, residual_blocks)
from sublinear.config import SublinearMemoryConfig
from sublinear.core.units import format_bytes
from sublinear.tools.maxbatch import (BATCH_LIMIT, DoesNotFit, NothingFits, StrategyResult, _bracket, compare,
                                fixed_floor, largest_fitting, strategies)
from sublinear.models import get_model


@pytest.mark.parametrize("answer", [0, 1, 2, 3, 17, 1000, BATCH_LIMIT])
@pytest.mark.parametrize("guess", [1, 8, 5000])
def test_largest_fitting_is_exact(answer, guess):
    assert largest_fitting(lambda batch: batch <= answer, guess) == answer


def search(peak, budget):
    """maxbatch's search on data-less devices (the bracket, then largest_fitting below the batch known not to fit),
    and how many batches it measured."""
    measured = {}

    def cached(batch):
        if batch not in measured:
            measured[batch] = peak(batch)
        return measured[batch]

    start, over = _bracket(cached, budget)
    best = largest_fitting(lambda batch: cached(batch) <= budget, start, BATCH_LIMIT if over is None else over - 1)
    return best, len(measured)


PEAKS = {
    "affine": lambda b: 1000 + 10 * b,
    # Fixed bytes (gradients of a large embedding) dominate small batches; activations take over later.
    "fixed then activations": lambda b: max(16_800_000 + 35_000 * b, 1_775_000 * b),
    "convex": lambda b: 500 + b * b,
    "monotone, not convex": lambda b: 1000 + 10 * b + (5000 if b > 30 else 0),
}


@pytest.mark.parametrize("shape", PEAKS)
@pytest.mark.parametrize("budget", [900, 1030, 1045, 1300, 6400, 20_000, 49_300_000, 10**12])
def test_bracketed_search_finds_the_exact_largest_batch(shape, budget):
    peak = PEAKS[shape]
    best, calls = search(peak, budget)
    assert best == bisect.bisect_right(range(1, BATCH_LIMIT + 1), budget, key=peak)  # peaks grow with the batch
    if shape in ("affine", "fixed then activations"):  # a step's peak: the largest of affine functions of the batch
        assert calls <= 6


def test_bracket_starts_from_a_batch_that_fits_when_fixed_bytes_hide_the_activations():
    peak = PEAKS["fixed then activations"]
    best, calls = search(peak, 49_300_000)
    assert best == 27 and calls <= 6  # the line through batches 2 and 4 alone points at batch 936


def test_bracket_without_measurements_starts_at_8():
    assert _bracket(lambda batch: None, 100) == (8, None)


class Blocks(nn.Module):
    """Layers in a ModuleList named ``layers`` whose entries hold a ModuleList named ``layer`` of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Inner() for _ in range(3))
        self.norms = nn.ModuleList(nn.ModuleDict({"n": nn.LayerNorm(8)}) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        return self.layer[1](torch.relu(self.layer[0](x))) + x


def test_residual_blocks_are_the_outermost_layer_lists():
    model = Blocks()
    assert [(container is model.layers, name) for container, name in residual_blocks(model)] == [
        (True, "0"), (True, "1"), (True, "2")]
    with pytest.raises(NotApplicable, match="no residual blocks or transformer layers found in Sequential"):
        residual_blocks(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    with pytest.raises(NotApplicable, match="not a transformers model"):
        hf_gradient_checkpointing(Blocks())


def test_baselines_edit_each_model_once():
    spec = get_model("tiny-resnet")
    prepare = dict(strategies((), None, None, spec))["checkpoint every block"]
    with torch.device("meta"):
        model = spec.build()
    blocks = len(residual_blocks(model))
    for batch in (2, 4, 8):
        assert prepare(model, batch) is model
    wrapped = [m for m in model.modules() if isinstance(m, _Checkpointed)]
    assert len(wrapped) == blocks  # not nested: applied at the first batch only
    twice = checkpoint_blocks(checkpoint_blocks(Blocks()))
    assert sum(isinstance(m, _Checkpointed) for m in twice.modules()) == 6  # applying again does nest


@pytest.mark.slow
def test_hf_gradient_checkpointing_row(monkeypatch):
    import transformers  # noqa: F401  (in the test extra)
    import sublinear.tools.maxbatch
    from sublinear.models.hf import hf_model

    kept = ("checkpoint_sequential sqrt(n)", "HF gradient_checkpointing_enable")  # "every block" matches HF's
    monkeypatch.setattr(sublinear.tools.maxbatch, "BASELINES", {name: BASELINES[name] for name in kept})
    spec = hf_model("BertForSequenceClassification", layers=2, hidden=32)
    notes = []
    rows = {r.strategy: r for r in compare(spec, 24 * 2**20, (), seq=64, note=notes.append)}
    assert set(rows) == {"eager", "HF gradient_checkpointing_enable"}
    hf, eager = rows["HF gradient_checkpointing_enable"], rows["eager"]
    assert eager.max_batch > 0 and hf.max_batch > eager.max_batch
    assert 1.2 < hf.flops_ratio < 1.5  # every layer's forward runs twice
    assert hf.time_ratio > 1.2 and eager.time_ratio == 1.0
    assert hf.peak_bytes <= 24 * 2**20 and hf.device == "meta"
    assert notes == [f"{spec.name}: checkpoint_sequential sqrt(n) skipped: checkpoint_sequential passes one tensor "
                     "between blocks, and these blocks take more arguments"]


@pytest.mark.slow
def test_planning_seconds_are_the_wall_time_of_planning_at_the_max_batch(monkeypatch):
    """Capture, profile and search of every graph at the max batch, not what the last re-plan took."""
    import time

    import sublinear.tools.maxbatch

    real = sublinear.tools.maxbatch.sublinear_compile
    planned_batches = []

    def slow_compile(model, args, kwargs, config):
        planned_batches.append(args[0].shape[0])
        time.sleep(0.05)
        return real(model, args, kwargs, config=config)
    monkeypatch.setattr(sublinear.tools.maxbatch, "sublinear_compile", slow_compile)
    from conftest import Chain
    from sublinear.models import ModelSpec

    spec = ModelSpec("chain", "8 Linear+GELU layers", lambda: Chain(8, width=64),
                     lambda batch, device="cpu", seq=None: ((torch.randn(batch, 64, device=device),), {}), None)
    (row,) = compare(spec, 2**20, (0,), baselines=False, config=SublinearMemoryConfig(planners=("grid",)))[1:]
    assert row.max_batch in planned_batches
    assert 0.05 <= row.planning_seconds < 60


def _chain_spec(width: int = 64):
    from conftest import Chain
    from sublinear.models import ModelSpec

    return ModelSpec("chain", "8 Linear+GELU layers", lambda: Chain(8, width=width),
                     lambda batch, device="cpu", seq=None: ((torch.randn(batch, width, device=device),), {}), None)


def test_a_budget_below_the_fixed_bytes_fails_before_any_strategy_runs(monkeypatch):
    import sublinear.tools.maxbatch

    def no_search(*args, **kwargs):
        raise AssertionError("a strategy ran under a budget no strategy can meet")

    monkeypatch.setattr(sublinear.tools.maxbatch, "_largest_batch", no_search)
    spec = _chain_spec()
    floor = fixed_floor(spec, None)
    parameters = 8 * (64 * 64 + 64) * 4
    assert floor.parts == (("parameters", parameters), ("buffers", 0), ("inputs", 64 * 4), ("gradients", parameters))
    with pytest.raises(NothingFits, match=r"chain: the budget \(1.00 KiB\) is below what a training step holds at "
                                          r"batch 1 whatever the strategy: parameters 130 KiB, buffers 0 B, inputs "
                                          r"256 B, gradients 130 KiB = 260 KiB .*at least 260 KiB$"):
        compare(spec, 1024, (0,))


def test_a_budget_no_strategy_meets_at_batch_1_names_the_least_need(monkeypatch):
    import sublinear.tools.maxbatch

    spec = _chain_spec()
    budget = fixed_floor(spec, None).total + 1  # above the fixed bytes, below any step's activations
    eager = sublinear.tools.maxbatch._largest_batch(spec, "eager", lambda model, batch: model, budget,
                                              sublinear.tools.maxbatch.StepEnvironment("meta", None), None)
    assert eager.max_batch == 0 and eager.least_need[0] == 1 and eager.least_need[1] > budget
    config = SublinearMemoryConfig(planners=("grid",), cache_dir="", cost_model="estimate")
    (_, planned), = strategies((0,), config, None, spec, baselines=False, budget=budget)[1:]
    with torch.device("meta"), pytest.raises(DoesNotFit) as info:
        planned(spec.build().train(), 1)
    assert budget < info.value.needed_bytes <= eager.least_need[1]  # the lowest peak the planner found

    def refused(model, batch):
        raise DoesNotFit("no plan fits", 10 * batch * budget)
    refusing = sublinear.tools.maxbatch._largest_batch(spec, "sublinear", refused, budget,
                                                 sublinear.tools.maxbatch.StepEnvironment("meta", None), None)
    assert refusing.max_batch == 0 and refusing.least_need == (1, 10 * budget)
    rows = [eager, refusing]
    monkeypatch.setattr(sublinear.tools.maxbatch, "_largest_batch", lambda spec, name, *args: rows.pop(0))
    with pytest.raises(NothingFits, match=rf"chain: no strategy fits batch 1 in {format_bytes(budget)}; the least "
                                          rf"needed is {format_bytes(eager.least_need[1])} \(eager at batch 1\): "
                                          r"raise the budget to at least that$"):
        compare(spec, budget, (0,), baselines=False)


def test_rows_that_fit_no_batch_show_no_ratios():
    from sublinear.tools.report import maxbatch_markdown, maxbatch_text

    rows = [StrategyResult("eager", 0, 0, float("nan"), float("nan"), None, None, "meta", (1, 5000)),
            StrategyResult("sublinear", 3, 900, 1.2, 1.1, 0.5, 800, "meta")]
    text = maxbatch_text("chain", rows)
    assert "nan" not in text and text.splitlines()[2].split()[1:] == ["0", "0.00", "-", "-", "-"]
    table = maxbatch_markdown({"chain": rows}, 1536, "meta", "sublinear maxbatch")
    assert "nan" not in table and "| chain | eager | 0 | 0.00 | - | - | - | 0 |" in table
    assert table.startswith("Budget 1.50 KiB on meta;")


@pytest.mark.slow
def test_a_causal_lm_on_fake_tensors_runs_the_plan_it_reports_with_its_head_chunked(monkeypatch):
    """The tool plans and steps transformers models on a twin with fake CPU tensors: the plan made ahead and the
    step's calls stand for the meta model (planned for the eager executor: inductor's kernels would read the fakes'
    null data, and its compiled-memory estimate is not the eager step's), the plan made ahead is the one the step
    runs, and the step measured is the plan predicted, the chunked LM head included (GPT-2's class names no loss
    type: transformers' once-only warning about it, before the loss, is left out of the graph)."""
    import transformers  # noqa: F401  (in the test extra)
    from sublinear.models.hf import hf_model
    from sublinear.tools.maxbatch import StepEnvironment, _PlannedAtBatch, _step_peak

    monkeypatch.delenv("SUBLINEAR_COMPILER")  # the default: inductor where it compiles for the values' device
    # TorchDynamo remembers per code object which sizes changed: after another GPT-2 in this process its frames
    # capture dynamic graphs, planned for their sizes' power-of-two bucket (above this step's measured peak)
    torch._dynamo.reset()
    spec = hf_model("GPT2LMHeadModel", layers=1, hidden=64)
    env = StepEnvironment.for_model(spec, "meta", None)
    model = env.build(spec)
    assert model.loss_type is None
    prepare = _PlannedAtBatch(spec, 256, SublinearMemoryConfig(memory_budget=2**40))
    with env:
        module = prepare(model, 4)
        ahead = module.sublinear_plan
        measured = _step_peak(spec, module, model, 4, env, 256)
    assert len(ahead.graphs) == 1
    assert all("eager executor" in graph.executor for graph in ahead.graphs + module.sublinear_plan.graphs)
    assert "computed in chunks" in module.sublinear_plan.graphs[0].lm_heads[0]
    assert module.sublinear_plan.predicted_peak_bytes == ahead.predicted_peak_bytes
    assert abs(measured - module.sublinear_plan.predicted_peak_bytes) <= 0.01 * measured
