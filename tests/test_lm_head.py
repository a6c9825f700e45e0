"""LM heads and their losses found in captured graphs and computed in chunks (sublinear.capture.lm_head and
lm_head_op): equal to the unchunked step to float rounding, on both executors, under changing lengths and padding,
with the logits the model returns intact, and the memory the chunks save seen by the prediction."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sublinear
from sublinear.capture import returned_logits
from sublinear.capture.lm_head import chunk_rows
from sublinear.capture.lm_head_op import chunked_linear_cross_entropy
from sublinear.measurement import measure_cpu_allocator
from sublinear.profiling.costs import REFERENCE_GPU, DeviceRates, device_rates, estimate_seconds
from sublinear.profiling.tracking import inside_peak
from sublinear.runtime import session
from sublinear.runtime.head_chunks import HEADROOM, HeadChunks
from sublinear.simulation.timeline import simulate

from conftest import PLAIN, assert_trains_to_rounding, close_to_rounding, token_batches, train_lm

CHUNKED = dataclasses.replace(PLAIN, chunk_lm_heads=True, memory_budget=None)
INDUCTOR = dataclasses.replace(CHUNKED, compiler="inductor")


@pytest.fixture(autouse=True)
def _chunks_of_32_rows(monkeypatch):
    """Chunks of 32 rows (24 for half-precision heads) whatever this machine's measured rates: these small heads
    then span several chunks."""
    monkeypatch.setattr(session, "device_rates", lambda device: DeviceRates(device, 0.6, 1.0, 0.0))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["hard", "smoothed"])
@pytest.mark.parametrize("reads_logits", [False, True], ids=["computes-logits", "reads-logits"])
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["linear", "soft-capped"])
def test_the_chunked_loss_and_gradients_equal_the_unchunked(bias, reduction, label_smoothing, reads_logits, softcap):
    torch.manual_seed(0)
    tokens, width, vocabulary = 37, 16, 50  # 37 rows in chunks of 8: a short last chunk
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocabulary, width, requires_grad=True)
    b = torch.randn(vocabulary, requires_grad=True) if bias else None
    target = torch.randint(0, vocabulary, (tokens,))
    target[::5] = -100  # padding
    leaves = [t for t in (hidden, weight, b) if t is not None]

    def head() -> torch.Tensor:
        logits = F.linear(hidden, weight, b)
        return torch.tanh(logits / softcap) * softcap if softcap else logits

    expected = F.cross_entropy(head(), target, reduction=reduction, label_smoothing=label_smoothing)
    expected_grads = torch.autograd.grad(expected * 1.7, leaves)
    logits = head().detach() if reads_logits else None
    loss = chunked_linear_cross_entropy(hidden, weight, b, target, logits, -100, reduction, label_smoothing,
                                        torch.float32, 8, softcap)
    grads = torch.autograd.grad(loss * 1.7, leaves)
    assert close_to_rounding(loss, expected)
    assert all(close_to_rounding(g, e) for g, e in zip(grads, expected_grads))


def _llama(vocabulary: int = 1000, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config).train()


@pytest.mark.slow
@pytest.mark.parametrize("through_logits", [False, True], ids=["loss", "loss-and-logits"])
@pytest.mark.parametrize("config", [CHUNKED, INDUCTOR], ids=["eager-executor", "inductor"])
def test_an_hf_causal_lm_head_is_chunked_and_trains_like_eager_over_changing_lengths_with_padding(config,
                                                                                                   through_logits):
    """The caller reads the logits (they are the model's) and, in one case, backpropagates a loss on them too:
    they are computed when read, and their gradient reaches the model through the head outside the graph."""
    model = _llama()
    batches = token_batches([16, 16, 24])
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches, keep_logits=True, through_logits=through_logits)
    run = sublinear.apply(model, config)
    got = train_lm(run, model, batches, keep_logits=True, through_logits=through_logits)
    assert_trains_to_rounding(got, expected)
    graph = model.sublinear_plan.graphs[0]
    assert len(graph.lm_heads) == 1 and graph.lm_heads[0].startswith("LM head lm_head (vocabulary 1,000, hidden 32)")
    assert "the logits the model returns computed only if read" in graph.lm_heads[0]



@pytest.mark.slow
def test_a_step_that_reads_only_the_loss_never_makes_the_logits_the_model_returns(caplog, monkeypatch):
    """Hugging Face returns the logits beside the loss: forward does not compute them (the whole step holds less
    than they would), the prediction counts none, and the caller still gets them, computed when read, equal to
    eager's, with a warning (once per head in a process: forgotten here, as other tests read this head's logits)."""
    monkeypatch.setattr(returned_logits, "_READ_HEADS", set())
    model, (ids, labels) = _llama(vocabulary=8000), token_batches([64], vocabulary=8000)[0]
    reference = copy.deepcopy(model)
    run = sublinear.apply(model, CHUNKED)

    def step(m):
        m(input_ids=ids, labels=labels).loss.backward()

    for _ in range(2):
        step(run)
        model.zero_grad(set_to_none=True)
    measured = measure_cpu_allocator(step, run).peak_bytes
    predicted = model.sublinear_plan.predicted_peak_bytes
    assert measured < ids.numel() * 8000 * 4  # the logits, float32
    assert abs(predicted - measured) <= max(0.02 * measured, 256 * 1024), (predicted, measured)
    out = run(input_ids=ids, labels=labels)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        assert close_to_rounding(out.logits, reference(input_ids=ids, labels=labels).logits.detach())
    assert "the logits of the chunked LM head lm_head were read" in caplog.text


@pytest.mark.slow
def test_logits_read_after_the_optimizer_changed_the_head_raise_what_to_do():
    model, (ids, labels) = _llama(), token_batches([64])[0]
    run = sublinear.apply(model, CHUNKED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = run(input_ids=ids, labels=labels)
    out.loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"changed in place since .* Read the logits before optimizer.step\(\)"):
        out.logits.argmax(-1)


@pytest.mark.parametrize("config", [CHUNKED, pytest.param(INDUCTOR, marks=pytest.mark.slow)],
                         ids=["eager-executor", "inductor"])
@pytest.mark.slow
def test_under_a_memory_budget_a_chunked_head_trains_like_eager_and_the_step_holds_the_budget(config):
    """The budget halfway from the lowest plan's predicted peak to eager's (both with the head chunked)."""
    model, batches = _llama(), token_batches([32, 32, 32])
    lowest = copy.deepcopy(model)
    run = sublinear.apply(lowest, config)
    run(input_ids=batches[0][0], labels=batches[0][1]).loss.backward()
    plan = lowest.sublinear_plan.graphs[0]
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
    budget = (plan.predicted_peak_bytes + plan.baseline_peak_bytes) // 2
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches)
    run = sublinear.apply(model, dataclasses.replace(config, memory_budget=budget))
    assert_trains_to_rounding(train_lm(run, model, batches), expected)
    assert "computed in chunks" in model.sublinear_plan.graphs[0].lm_heads[0]
    ids, labels = batches[0]
    measured = measure_cpu_allocator(lambda m: m(input_ids=ids, labels=labels).loss.backward(), model).peak_bytes
    assert measured <= budget, (measured, budget)


@pytest.mark.parametrize("config", [CHUNKED, pytest.param(INDUCTOR, marks=pytest.mark.slow)],
                         ids=["eager-executor", "inductor"])
@pytest.mark.slow
def test_under_a_budget_the_chunk_grows_into_the_memory_the_plan_leaves(config):
    """A budget 20 % of eager's activations above eager's peak (chunks of 32 rows): the plan recomputes nothing
    and the chunk grows to the most rows at which the prediction stays within the budget less the headroom, not
    to every token; the step trains as eager and measures within its prediction."""
    model, batches = _llama(), token_batches([32, 32])
    lowest = copy.deepcopy(model)
    run = sublinear.apply(lowest, config)
    run(input_ids=batches[0][0], labels=batches[0][1]).loss.backward()
    plan = lowest.sublinear_plan.graphs[0]
    budget = plan.baseline_peak_bytes + (plan.baseline_peak_bytes - plan.predicted_peak_bytes) // 5
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches)
    run = sublinear.apply(model, dataclasses.replace(config, memory_budget=budget))
    assert_trains_to_rounding(train_lm(run, model, batches), expected)
    backend = model.forward.sublinear_backend
    variant = next(iter(backend.latest.values()))
    head, chunks = backend.graphs[0].graph.lm_heads[0], variant.lesson.chunks
    rows, [(op, added)] = chunks.rows[0], chunks.added
    assert head.rows < rows < head.tokens, (head.rows, rows)
    assert f"chunks of {rows} of {head.tokens} tokens" in model.sublinear_plan.graphs[0].lm_heads[0]
    limit = budget - int(budget * HEADROOM)
    larger = HeadChunks((rows + 8,), ((op, head.scratch(rows + 8) - head.scratch(rows)),)).applied(variant.profile)
    assert variant.peak_bytes <= limit < simulate(larger, variant.plan).peak_bytes
    # the compile check taught the profile at the grown chunk and keeps it at the captured one, for other plans
    profiled = variant.lesson.profiled
    assert profiled.profile.ops[op].forward_extra_bytes == profiled.untaught.ops[op].forward_extra_bytes
    assert variant.profile.ops[op].forward_extra_bytes == profiled.untaught.ops[op].forward_extra_bytes + added
    ids, labels = batches[0]
    measured = measure_cpu_allocator(lambda m: m(input_ids=ids, labels=labels).loss.backward(), model).peak_bytes
    assert measured <= variant.peak_bytes


@pytest.mark.slow
def test_a_dynamic_graphs_chunk_grows_at_the_token_count_of_the_sizes_it_is_planned_for():
    """Lengths that change every step: the graph is captured with a symbolic length and planned at its bound. Under
    a budget far above the step, the chunk grows to every token at the bound; training is as eager."""
    model, batches = _llama(), token_batches([24, 40, 32, 48])
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches)
    run = sublinear.apply(model, dataclasses.replace(CHUNKED, memory_budget=1 << 30))
    assert_trains_to_rounding(train_lm(run, model, batches), expected)
    backend = model.forward.sublinear_backend
    variant = next(iter(backend.latest.values()))
    graph = backend.graphs[-1].graph
    head = graph.lm_heads[0]
    assert graph.sizes is not None and head.token_expression and variant.bound
    at_bound = 4 * max(variant.bound.values())
    assert variant.lesson.chunks.rows == (at_bound,) and head.rows < at_bound


@pytest.mark.slow
def test_returned_logits_no_gradient_reaches_cost_no_matmul_in_the_compiled_backward():
    """AOTAutograd gives an output no gradient reaches a zero gradient: had the graph returned the logits attached,
    its backward would run the head's two matmuls on it in every step."""
    from torch.utils.flop_counter import FlopCounterMode
    model = _llama()
    run = sublinear.apply(model, INDUCTOR)
    ids, labels = token_batches([64])[0]
    for _ in range(3):
        out = run(input_ids=ids, labels=labels)
        with FlopCounterMode(display=False) as counter:
            out.loss.backward()
        model.zero_grad(set_to_none=True)
    tokens, vocabulary, hidden = ids.numel(), 1000, 32
    head_matmuls = 2 * (2 * tokens * vocabulary * hidden)
    attention = sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if "attention" in str(op))
    assert 0 < counter.get_total_flops() - attention < head_matmuls


class _Head(nn.Module):
    """A body, a head of ``classes`` outputs and its loss inside forward, returning the loss alone (or with a print
    between the head and the loss: a graph break)."""

    def __init__(self, classes: int, width: int = 32, broken: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, classes)
        self.broken = broken

    def forward(self, x, target):
        logits = self.head(self.body(x))
        if self.broken:
            print(end="")
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)



@pytest.mark.parametrize("reads_logits", [False, True], ids=["computes-logits", "reads-logits"])
def test_the_op_holds_two_chunks_of_logits_at_a_time_beside_the_weight_gradient(reads_logits):
    """Under bf16 autocast (bf16 head, float32 loss): inside the op, a chunk's float32 logits and their
    log-softmax (which becomes the gradient in place), the float32 weight-gradient sum and one chunk's bf16 product
    for it; no chunk's values outlive it into the next one."""
    torch.manual_seed(0)
    tokens, width, vocabulary, rows = 256, 32, 8000, 32
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16)
    weight = torch.randn(vocabulary, width, dtype=torch.bfloat16)
    target = torch.randint(0, vocabulary, (tokens,))
    logits = F.linear(hidden, weight) if reads_logits else None

    def op(_unused):
        return chunked_linear_cross_entropy(hidden, weight, None, target, logits, -100, "mean", 0.0, torch.float32,
                                            rows)

    inside = measure_cpu_allocator(op, nn.Module()).peak_bytes
    chunk, weight_sized = rows * vocabulary * 4, vocabulary * width
    bound = 2 * chunk + weight_sized * (4 + 2 + 2) + 64 * 1024  # float32 sum, a bf16 product, the bf16 result
    assert inside <= bound, (inside, bound)


@pytest.mark.parametrize("reads_logits", [False, True], ids=["computes-logits", "reads-logits"])
def test_the_ops_inside_peak_counted_on_meta_is_the_cpu_allocators(reads_logits):
    """The chunks the op holds, counted by running its code on meta copies of its arguments (how meta plans and
    ``sublinear.measure`` see them), are what the CPU allocator holds inside the call beyond its results (float32:
    a half-precision matrix product may allocate inside the library, which no count on meta sees)."""
    torch.manual_seed(0)
    tokens, width, vocabulary, rows = 200, 32, 3000, 48  # a short last chunk
    hidden, weight = torch.randn(tokens, width), torch.randn(vocabulary, width)
    target = torch.randint(0, vocabulary, (tokens,))
    logits = F.linear(hidden, weight) if reads_logits else None
    args = (hidden, weight, None, target, logits, -100, "mean", 0.1, torch.float32, rows, 0.0)
    op = torch.ops.sublinear.linear_cross_entropy.default
    results = sum(t.untyped_storage().nbytes() for t in op(*args))
    # the least of three: the allocator's count takes in what other threads of the process allocate meanwhile
    allocator = min(measure_cpu_allocator(lambda _unused: op(*args), nn.Module()).peak_bytes for _ in range(3))
    allocator -= results
    counted = inside_peak(op, args)
    assert counted > rows * vocabulary * 4  # at least a chunk's log-softmax
    assert abs(counted - allocator) <= 1024, (counted, allocator)  # beside a scalar another thread may allocate


def test_on_meta_the_predicted_and_the_measured_peak_both_hold_the_chunks(monkeypatch):
    """On meta the op's registered meta kernel allocates only its results: the prediction and ``sublinear.measure``
    count its two chunks of logits all the same, and agree (chunks of the reference GPU's rows, all 512 tokens)."""
    monkeypatch.setattr(session, "device_rates", device_rates)
    classes, tokens = 6000, 512
    with torch.device("meta"):
        model = _Head(classes=classes)
    x, target = torch.randn(4, tokens // 4, 32, device="meta"), torch.zeros(4, tokens // 4, dtype=torch.long,
                                                                             device="meta")
    run = sublinear.compile(model, (x, target), config=CHUNKED)
    _step(run, x, target)
    measured = sublinear.measure(_step, run, x, target).peak_bytes
    head = run.sublinear_plan.graphs[0].lm_heads[0]
    rows = int(head.split("chunks of ")[1].split()[0])
    held = sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4 + target.numel() * 8
    assert measured > held + 2 * rows * classes * 4, (measured, rows, head)
    predicted = run.sublinear_plan.predicted_peak_bytes
    assert abs(predicted - measured) <= max(0.02 * measured, 256 * 1024), (predicted, measured)


@pytest.mark.parametrize("rates", [REFERENCE_GPU, DeviceRates("cpu-like", 8e10, 2.4e10, 2e-6)], ids=["gpu", "cpu"])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_chunks_are_the_fewest_rows_whose_weight_passes_cost_at_most_five_percent(rates, itemsize):
    """On the profiler's roofline times (``estimate_seconds``): the chunks' passes over the weight (read twice) and
    its float32 gradient (read and written) take at most 5 % of the head's products' time, and would take more with
    8 rows fewer."""
    tokens, width, vocabulary = 1 << 24, 512, 32000
    products = estimate_seconds(6 * tokens * width * vocabulary, 0, 0, rates)

    def passes(rows: int) -> float:
        return -(-tokens // rows) * estimate_seconds(0, (2 * itemsize + 8) * width * vocabulary, 0, rates)

    rows = chunk_rows(tokens, itemsize, rates.flops_per_second / rates.bytes_per_second)
    assert rows % 8 == 0
    assert passes(rows) <= 0.05 * products < passes(rows - 8)
    assert chunk_rows(rows // 2, itemsize, rates.flops_per_second / rates.bytes_per_second) == rows // 2  # all tokens


def test_the_op_counts_the_flops_of_the_unchunked_heads_products():
    torch.manual_seed(0)
    hidden = torch.randn(96, 16, requires_grad=True)
    weight = torch.randn(500, 16, requires_grad=True)
    target = torch.randint(0, 500, (96,))
    counts = []
    for chunked in (True, False):
        with FlopCounterMode(display=False) as counter:
            loss = chunked_linear_cross_entropy(hidden, weight, None, target, None, -100, "mean", 0.0, torch.float32,
                                                32) if chunked else F.cross_entropy(F.linear(hidden, weight), target)
            loss.backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 6 * 96 * 16 * 500


def _step(run, x, target):
    run(x, target).backward()


def test_a_head_whose_logits_nothing_else_reads_computes_each_chunks_logits_and_holds_less():
    torch.manual_seed(0)
    model = _Head(classes=4000)
    x, target = torch.randn(4, 64, 32), torch.randint(0, 4000, (4, 64))
    reference = copy.deepcopy(model)
    eager_peak = measure_cpu_allocator(_step, reference, x, target).peak_bytes
    run = sublinear.compile(model, (x, target), config=CHUNKED)
    for _ in range(2):
        _step(run, x, target)
        model.zero_grad(set_to_none=True)
    measured = measure_cpu_allocator(_step, run, x, target).peak_bytes
    plan = run.sublinear_plan
    assert "computing each chunk's logits" in plan.graphs[0].lm_heads[0]
    logits = 4 * 64 * 4000 * 4
    assert measured < eager_peak - 2 * logits  # neither the log-softmax nor the logits' gradient is held whole
    assert abs(plan.predicted_peak_bytes - measured) <= max(0.02 * measured, 256 * 1024), \
        (plan.predicted_peak_bytes, measured)
    reference.zero_grad(set_to_none=True)
    _step(reference, x, target)
    model.zero_grad(set_to_none=True)
    _step(run, x, target)
    assert all(close_to_rounding(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize(("classes", "broken", "reason"), [
    (10, False, "10 classes, no more than the hidden size 32"),
    (4000, False, "16 tokens, fewer than twice the hidden size 32"),
    (4000, True, "the logits are an input of this graph (a graph break between the head and its loss)"),
], ids=["classifier", "few-tokens", "loss-after-a-graph-break"])
def test_a_cross_entropy_that_is_no_head_in_its_graph_is_left_alone_and_the_plan_says_why(classes, broken, reason):
    torch.manual_seed(0)
    model = _Head(classes, broken=broken)
    x, target = torch.randn(2, 8, 32), torch.randint(0, classes, (2, 8))
    expected = model(x, target)
    run = sublinear.compile(model, config=CHUNKED)
    loss = run(x, target)
    loss.backward()
    heads = [h for g in run.sublinear_plan.graphs for h in g.lm_heads]
    assert len(heads) == 1 and "left alone" in heads[0] and reason in heads[0], heads
    assert torch.equal(loss, expected)  # left alone: bit for bit the cross-entropy it was


class _ShiftedHead(nn.Module):
    """An LM written by hand: the logits' last position sliced off (the label shift of older code), made contiguous,
    flattened and upcast; the head tied to the embedding or a linear with a bias; the loss summed and divided by the
    tokens that count, or a mean, with label smoothing."""

    def __init__(self, tied: bool, vocabulary: int = 500, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = None if tied else nn.Linear(width, vocabulary)
        self.vocabulary = vocabulary

    def forward(self, ids, labels, summed: bool):
        h = self.body(self.embed(ids))
        logits = F.linear(h, self.embed.weight) if self.head is None else self.head(h)
        shifted = logits[:, :-1, :].contiguous().view(-1, self.vocabulary).float()
        targets = labels[:, 1:].reshape(-1)
        if summed:
            return F.cross_entropy(shifted, targets, reduction="sum", label_smoothing=0.1) / (targets >= 0).sum()
        return F.cross_entropy(shifted, targets, label_smoothing=0.1)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "linear"])
@pytest.mark.parametrize("summed", [True, False], ids=["sum", "mean"])
@pytest.mark.slow
def test_a_shifted_upcast_head_tied_or_not_summed_or_averaged_is_chunked_alike(tied, summed):
    torch.manual_seed(0)
    model = _ShiftedHead(tied)
    ids = torch.randint(0, 500, (3, 40))
    labels = ids.masked_fill(torch.rand(3, 40) < 0.2, -100)
    reference = copy.deepcopy(model)
    expected = reference(ids, labels, summed)
    expected.backward()
    run = sublinear.compile(model, (ids, labels), {"summed": summed}, config=CHUNKED)
    loss = run(ids, labels, summed=summed)
    loss.backward()
    heads = run.sublinear_plan.graphs[0].lm_heads
    assert len(heads) == 1 and "computed in chunks" in heads[0] and "computing each chunk's logits" in heads[0]
    assert close_to_rounding(loss, expected)
    assert all(close_to_rounding(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.slow
def test_hf_num_items_in_batch_sums_the_chunked_loss_and_divides_it():
    model = _llama()
    (ids, labels), = token_batches([20])
    items = (labels[:, 1:] != -100).sum()
    reference = copy.deepcopy(model)
    expected = reference(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    expected.backward()
    run = sublinear.apply(model, CHUNKED)
    loss = run(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    loss.backward()
    assert "computed in chunks" in model.sublinear_plan.graphs[0].lm_heads[0]
    assert close_to_rounding(loss, expected)
    assert all(close_to_rounding(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.slow
def test_a_soft_capped_gemma2_head_is_chunked_and_trains_like_eager():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0,
                          sliding_window=8, use_cache=False)
    model = Gemma2ForCausalLM(config).train()
    batches = token_batches([16, 24])
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches, keep_logits=True, through_logits=True)
    run = sublinear.apply(model, CHUNKED)
    assert_trains_to_rounding(train_lm(run, model, batches, keep_logits=True, through_logits=True), expected)
    head = model.sublinear_plan.graphs[0].lm_heads[0]
    assert "soft-capped at 30" in head and "the logits the model returns computed only if read" in head


@pytest.mark.slow
def test_a_bart_head_with_its_final_logits_bias_is_chunked_and_trains_like_eager():
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    config = BartConfig(vocab_size=1000, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    model = BartForConditionalGeneration(config).train()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # zeros would hide a bias left out
    batches = token_batches([16, 24])
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches, keep_logits=True, through_logits=True)
    run = sublinear.apply(model, CHUNKED)
    assert_trains_to_rounding(train_lm(run, model, batches, keep_logits=True, through_logits=True), expected)
    assert any("computed in chunks" in head for g in model.sublinear_plan.graphs for head in g.lm_heads)


def test_under_bf16_autocast_the_chunks_run_in_the_dtype_the_head_ran_in():
    """The rewrite casts the op's inputs as autocast cast the linear's; the chunks' bf16 products of the weight
    gradient are summed in float32, so it equals the unchunked step to bf16 rounding."""
    torch.manual_seed(0)
    model = _ShiftedHead(tied=False)
    ids = torch.randint(0, 500, (3, 40))
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(ids, ids, False)
        run = sublinear.compile(model, (ids, ids), {"summed": False}, config=CHUNKED)
        loss = run(ids, ids, summed=False)
    expected.backward()
    loss.backward()
    assert "computed in chunks" in run.sublinear_plan.graphs[0].lm_heads[0]
    assert close_to_rounding(loss, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        assert (p.grad - q.grad).abs().max() <= 2 ** -6 * q.grad.abs().max()  # bf16 keeps 8 bits


@pytest.mark.slow
def test_gpt2_whose_class_names_no_loss_type_is_one_graph_with_its_head_chunked():
    """transformers warns once, through its logger, inside GPT2LMHeadModel's forward that its class names no loss
    type, right before the loss; TorchDynamo cannot put a logging call in a graph and would break it there, parting
    the head from its loss. The capture leaves once-only logger calls out, for its own compiles only."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel
    ignored = set(torch._dynamo.config.ignore_logging_functions)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_embd=32, n_layer=1, n_head=2, n_positions=128)).train()
    assert model.loss_type is None
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    run = sublinear.compile(model, (), {"input_ids": ids, "labels": ids}, config=CHUNKED)
    graphs = run.sublinear_plan.graphs
    assert len(graphs) == 1 and "computed in chunks" in graphs[0].lm_heads[0], graphs
    assert torch._dynamo.config.ignore_logging_functions == ignored
    assert logging.Logger.warning_once not in ignored


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                      decoder_start_token_id=0)
    return T5ForConditionalGeneration(config), lambda g, length: {
        "input_ids": torch.randint(0, 1000, (4, length), generator=g)}


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    config = WhisperConfig(vocab_size=1000, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=64, pad_token_id=0, decoder_start_token_id=1,
                           bos_token_id=1, eos_token_id=2)
    return WhisperForConditionalGeneration(config), lambda g, length: {
        "input_features": torch.randn(4, 8, 32, generator=g)}


@pytest.mark.slow
@pytest.mark.parametrize("build", [_t5, _whisper], ids=["t5", "whisper"])
def test_seq2seq_heads_are_chunked_and_train_like_eager_over_changing_lengths(build):
    """T5's head (its tied embedding, the decoder output scaled before it) and Whisper's proj_out, each with the
    loss Hugging Face computes through nn.CrossEntropyLoss, labels padded."""
    torch.manual_seed(0)
    model, inputs = build()
    model.train()
    reference = copy.deepcopy(model)
    run = sublinear.apply(model, CHUNKED)
    torch.manual_seed(2)  # dropout draws alike
    for length in (24, 32):
        g = torch.Generator().manual_seed(length)
        batch = inputs(g, length)
        batch["labels"] = torch.randint(3, 1000, (4, length), generator=g)
        batch["labels"][0, length // 2:] = -100
        state = torch.get_rng_state()
        loss = run(**batch).loss
        loss.backward()
        torch.set_rng_state(state)
        expected = reference(**batch).loss
        expected.backward()
        assert close_to_rounding(loss, expected)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None) and (q.grad is None or close_to_rounding(p.grad, q.grad))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert "computed in chunks" in model.sublinear_plan.graphs[0].lm_heads[0]


@pytest.mark.parametrize("plan_of", [lambda n, head: [head, head + 1],
                                     pytest.param(lambda n, head: list(range(1, n)), marks=pytest.mark.slow)],
                         ids=["head-recomputed-alone", "every-op-a-block"])
@pytest.mark.slow
def test_a_chunked_head_recomputed_in_backward_measures_its_prediction(plan_of, monkeypatch):
    """The op's extra outputs (the gradients it computes in forward) get no zero gradient from autograd: one as
    large as the weight would be allocated as backward reaches the op, before its recompute, which the step's
    prediction does not hold (GPT-2 on meta: 1.09 MB over a 12.7 MB prediction). One chunk of all 256 tokens (the
    reference GPU's rates), so that the recompute is the step's peak."""
    from transformers import GPT2Config, GPT2LMHeadModel
    monkeypatch.setattr(session, "device_rates", lambda device: REFERENCE_GPU)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_embd=64, n_layer=1, n_head=2, n_positions=128,
                                           use_cache=False)).train()
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    run = sublinear.compile(model, (), {"input_ids": ids, "labels": ids}, config=CHUNKED)
    code, variant = next(iter(run.sublinear_backend.latest.items()))
    names = [op.name for op in variant.profile.ops]
    head = next(i for i, name in enumerate(names) if "linear_cross_entropy" in name)
    plan = sublinear.core.Plan.of(plan_of(len(names), head), len(names))
    run.use(sublinear.ParetoPoint(plan, 0, 0, 1.0, 1.0, code))
    measured = sublinear.measure(lambda m: m(input_ids=ids, labels=ids).loss.backward(), run).peak_bytes
    assert measured == run.sublinear_plan.predicted_peak_bytes


def test_a_half_precision_head_is_chunked_on_the_half_precision_product_rate(monkeypatch):
    """Under autocast the head's products run in bfloat16 (on tensor cores, often ten times the float32 rate): the
    5 % rule weighs its passes over the weight against that rate, so its chunks are that many times larger."""
    float32 = DeviceRates("pinned", 0.6, 1.0, 0.0)
    monkeypatch.setattr(session, "device_rates", lambda device: dataclasses.replace(float32, half_flops_per_second=3.0))
    torch.manual_seed(0)
    model = _ShiftedHead(tied=False)
    ids = torch.randint(0, 500, (3, 400))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run = sublinear.compile(model, (ids, ids), {"summed": False}, config=CHUNKED)
    head = run.sublinear_plan.graphs[0].lm_heads[0]
    tokens = ids.numel() - 3  # the label shift drops each sequence's last position
    assert f"chunks of {chunk_rows(tokens, 2, 3.0)} of {tokens} tokens" in head, head
    assert chunk_rows(tokens, 2, 3.0) > chunk_rows(tokens, 2, 0.6)
