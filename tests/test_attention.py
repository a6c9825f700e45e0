"""Scaled dot-product attention as plans see it (measured on meta as CPU runs it, its fused kernel's FLOPs), and
attention written out as its matrices computed by it (:mod:`sublinear.capture.attention`)."""

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sublinear
from sublinear.capture.attention import with_attention_fused
from sublinear.capture.dynamo import capture
from sublinear.measurement import measure_cpu_allocator

from conftest import PLAIN, assert_trains_to_rounding, close_to_rounding, token_batches, train_lm

BATCH, HEADS, TOKENS, WIDTH = 2, 4, 128, 32
OPTIONS = {
    "causal": dict(is_causal=True),
    "boolean mask": dict(attn_mask=torch.rand(BATCH, 1, TOKENS, TOKENS, generator=torch.Generator().manual_seed(0))
                         > 0.3),
    "scale": dict(scale=0.3),
    "grouped query": dict(enable_gqa=True),
    "dropout (math path on CPU too)": dict(dropout_p=0.1),
    "dropout and boolean mask": dict(dropout_p=0.1, attn_mask=torch.ones(BATCH, 1, TOKENS, TOKENS, dtype=torch.bool)),
}


def _attention(query, key, value, **options):
    F.scaled_dot_product_attention(query, key, value, **options).sum().backward()


def _query_key_value(device: str, key_heads: int = HEADS):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, HEADS, TOKENS, WIDTH, generator=generator).to(device).requires_grad_()
    key, value = (torch.randn(BATCH, key_heads, TOKENS, WIDTH, generator=generator).to(device).requires_grad_()
                  for _ in range(2))
    return query, key, value


@pytest.mark.parametrize("name", OPTIONS)
def test_attention_measured_on_meta_holds_what_it_holds_on_cpu(name):
    """On meta the call takes CPU's kernel (the math path would hold batch x heads x tokens x tokens, forward and
    backward)."""
    options = OPTIONS[name]
    key_heads = HEADS // 2 if options.get("enable_gqa") else HEADS
    peaks = {}
    for device in ("cpu", "meta"):
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        peaks[device] = sublinear.measure(_attention, *_query_key_value(device, key_heads), **on_device).peak_bytes
    assert peaks["meta"] == peaks["cpu"]


def test_cpu_fused_attention_counts_its_products_and_grouped_keys_at_the_query_heads():
    grouped = _query_key_value("cpu", HEADS // 2)
    query, key, value = grouped
    repeated = (query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1))
    counts = []
    for (q, k, v), gqa in ((grouped, True), (repeated, False)):
        with FlopCounterMode(display=False) as forward:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        with FlopCounterMode(display=False) as both:
            out.sum().backward()
        counts.append((forward.get_total_flops(), both.get_total_flops()))
    assert counts[0] == counts[1]
    assert counts[0][0] == 2 * (2 * BATCH * HEADS * TOKENS * TOKENS * WIDTH)  # scores, then the weighted values
    assert counts[0][1] > counts[0][0]


class _AttentionStack(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                 for _ in range(layers))

    def forward(self, x):
        b, s, w = x.shape
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
            x = x + mlp(x)
        return x.square().mean()


@pytest.mark.parametrize("budgeted", [False, True])
@pytest.mark.slow
def test_a_plan_made_on_meta_measures_its_prediction_with_attention(budgeted):
    """Recomputed blocks hold attention (backward's recomputations run outside any Python mode of the step)."""
    with torch.device("meta"):
        model, x = _AttentionStack(), torch.randn(4, 512, 64)
    budget = None
    if budgeted:  # halfway between the least-memory plan and eager
        lowest = sublinear.compile(_AttentionStack().to("meta"), (x,)).sublinear_plan
        budget = (lowest.predicted_peak_bytes + lowest.baseline_peak_bytes) // 2
    compiled = sublinear.compile(model, (x,), config=sublinear.SublinearMemoryConfig(memory_budget=budget))
    predicted = compiled.sublinear_plan.predicted_peak_bytes
    measured = sublinear.measure(lambda m, x: m(x).backward(), compiled, x).peak_bytes
    assert measured == pytest.approx(predicted, rel=0.01)
    assert budget is None or measured <= budget


class _WrittenOut(nn.Module):
    """One attention written out as its matrices, in a chosen variant: the scale multiplied or divided, a mask added,
    the softmax in float32 and cast back, a dropout, grouped keys repeated, the probabilities also returned."""

    def __init__(self, variant: str, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.variant, self.heads = variant, heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x, mask):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.variant == "grouped":  # two key heads, repeated as Hugging Face's repeat_kv does
            k, v = (t[:, ::2, None].expand(b, 2, 2, s, w // self.heads).reshape(b, 4, s, -1) for t in (k, v))
        if self.variant == "divided":
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(w // self.heads)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * (w // self.heads) ** -0.5
        if self.variant != "unmasked":
            scores = scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        p = 0.1 if self.variant == "dropout" else 0.0
        weights = F.dropout(weights, p=p, training=self.training)
        out = self.out(torch.matmul(weights, v).transpose(1, 2).reshape(b, s, w))
        return (out, weights) if self.variant == "returned" else out


FUSED = dataclasses.replace(PLAIN, fuse_attention=True)
_FUSED = ("multiplied", "divided", "unmasked", "grouped")
_LEFT_ALONE = {"dropout": "its dropout (p=0.1) draws random numbers",
               "returned": "its probabilities are read elsewhere"}


def _written_out_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=generator)
    mask = torch.zeros(2, 1, 16, 16).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), torch.finfo().min)
    return x, mask


@pytest.mark.parametrize("variant", _FUSED + tuple(_LEFT_ALONE))
def test_attention_written_out_is_computed_by_the_fused_call_to_float_rounding_or_left_alone_saying_why(variant):
    torch.manual_seed(0)
    model = _WrittenOut(variant).train()
    x, mask = _written_out_inputs()
    graph = with_attention_fused(capture(model, (x, mask)).graph)
    assert len(graph.attention) == 1
    site = graph.attention[0]
    targets = {n.target for n in graph.graph_module.graph.nodes}
    if variant in _LEFT_ALONE:
        assert not site.fused and _LEFT_ALONE[variant] in site.reason and F.softmax in targets
        return
    assert site.fused and F.scaled_dot_product_attention in targets and F.softmax not in targets
    reference = copy.deepcopy(model)
    expected = reference(x, mask)
    expected.square().sum().backward()
    compiled = sublinear.compile(model, (x, mask), config=FUSED)
    got = compiled(x, mask)
    got.square().sum().backward()
    assert close_to_rounding(got, expected)
    assert all(close_to_rounding(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert "computed by F.scaled_dot_product_attention" in str(compiled.sublinear_plan.graphs[0])


def _causal_lm(family: str) -> nn.Module:
    """A tiny Hugging Face causal LM with eager attention: Llama with grouped keys, or GPT-2 whose attention
    dropout is off (its residual and MLP dropouts stay on)."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
        return transformers.LlamaForCausalLM(config).train()
    config = transformers.GPT2Config(vocab_size=1000, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).train()


@pytest.mark.slow
@pytest.mark.parametrize("budgeted", [False, True], ids=["no-budget", "budget"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_hf_models_eager_attention_is_fused_and_trains_like_eager_over_changing_lengths(family, compiler,
                                                                                            budgeted):
    """The budget is halfway from the lowest plan's predicted peak to eager's at one length, and the step measures
    within it; inductor draws dropout's random numbers as eager does (``fallback_random``)."""
    model, batches = _causal_lm(family), token_batches([16, 16, 16] if budgeted else [16, 16, 24])
    config = dataclasses.replace(FUSED, compiler=compiler)
    if budgeted:
        lowest = copy.deepcopy(model)
        sublinear.apply(lowest, config)(input_ids=batches[0][0], labels=batches[0][1]).loss.backward()
        plan = lowest.sublinear_plan.graphs[0]
        config = dataclasses.replace(config, memory_budget=(plan.predicted_peak_bytes + plan.baseline_peak_bytes) // 2)
    reference = copy.deepcopy(model)
    expected = train_lm(reference, reference, batches)
    run = sublinear.apply(model, config)
    with torch._inductor.config.patch(fallback_random=True):
        assert_trains_to_rounding(train_lm(run, model, batches), expected)
    assert "attention at 2 sites" in str(model.sublinear_plan.graphs[0])
    if budgeted:
        ids, labels = batches[0]
        measured = measure_cpu_allocator(lambda m: m(input_ids=ids, labels=labels).loss.backward(), model).peak_bytes
        assert measured <= config.memory_budget, (measured, config.memory_budget)


@pytest.mark.slow
def test_fused_attention_holds_less_than_its_matrices_and_is_predicted_as_measured():
    """Four heads over 256 tokens: each layer's probabilities (and their gradient) are 1 MiB a sequence."""
    model, (ids, labels) = _causal_lm("llama"), token_batches([256])[0]

    def step(m):  # the output held through backward, as predicted
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()

    peaks = {}
    for fused in (False, True):
        run = sublinear.compile(copy.deepcopy(model), example_kwargs=dict(input_ids=ids, labels=labels),
                                config=dataclasses.replace(FUSED, fuse_attention=fused, max_time_ratio=1.0))
        measured = measure_cpu_allocator(step, run).peak_bytes
        predicted = run.sublinear_plan.predicted_peak_bytes
        assert measured == pytest.approx(predicted, rel=0.02)
        peaks[fused] = measured
    assert peaks[True] < peaks[False] - 4 * 2**20, peaks


def test_a_pareto_point_is_of_the_graph_with_attention_fused_and_runs_when_used():
    torch.manual_seed(0)
    model = _WrittenOut("multiplied").train()
    x, mask = _written_out_inputs()
    points = sublinear.pareto(model, (x, mask), config=FUSED, budgets=2)
    compiled = sublinear.compile(model, (x, mask), config=FUSED)
    compiled.use(points[0])
    compiled(x, mask).sum().backward()
    graph = compiled.sublinear_plan.graphs[0]
    assert graph.plan == points[0].plan and graph.origin == "use()", graph


class _CrossAttention(nn.Module):
    """Queries from one sequence, keys and values from another (of another length), scaled by a number, with an
    additive mask of the given shape (broadcast over what it leaves out)."""

    def __init__(self, heads: int, width: int, scale: float, divide: bool, mask_shape) -> None:
        super().__init__()
        self.heads, self.scale, self.divide, self.mask_shape = heads, scale, divide, mask_shape
        self.q, self.kv = nn.Linear(width, width), nn.Linear(width, 2 * width)

    def forward(self, x, memory, mask):
        b, length, w = x.shape
        q = self.q(x).view(b, length, self.heads, -1).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores = scores / self.scale if self.divide else scores * self.scale
        if mask is not None:
            scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, length, w)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), queries=st.integers(1, 9), keys=st.integers(1, 9),
       scale=st.floats(0.05, 4.0), divide=st.booleans(), mask=st.sampled_from(["none", "full", "per-key", "per-head"]))
def test_any_written_out_attention_is_fused_to_float_rounding(heads, queries, keys, scale, divide, mask):
    batch, width = 2, 8 * heads
    shapes = {"none": None, "full": (batch, heads, queries, keys), "per-key": (batch, 1, 1, keys),
              "per-head": (1, heads, queries, keys)}
    generator = torch.Generator().manual_seed(queries * 10 + keys)
    x, memory = torch.randn(batch, queries, width, generator=generator), torch.randn(batch, keys, width,
                                                                                    generator=generator)
    additive = torch.randn(*shapes[mask], generator=generator) if shapes[mask] else None
    torch.manual_seed(0)
    model = _CrossAttention(heads, width, scale, divide, shapes[mask]).train()
    reference = copy.deepcopy(model)
    expected = reference(x, memory, additive)
    expected.square().sum().backward()
    compiled = sublinear.compile(model, (x, memory, additive), config=FUSED)
    got = compiled(x, memory, additive)
    got.square().sum().backward()
    assert "computed by F.scaled_dot_product_attention" in str(compiled.sublinear_plan.graphs[0])
    assert close_to_rounding(got, expected)
    # a single key makes the queries' and keys' gradients zero but for rounding: measured against the largest
    scale = max(q.grad.abs().max() for q in reference.parameters())
    assert all((p.grad - q.grad).abs().max() <= 1e-5 * scale for p, q in zip(model.parameters(),
                                                                                reference.parameters()))
