"""Scaled dot-product attention as plans see it: measured on meta as CPU runs it, and its fused kernel's FLOPs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sublinear

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
