"""Tests for the built-in model zoo (``sublinear.models``).

Full-size models are only ever built under ``torch.device("meta")`` (no
storage, no compute); numerical checks use the tiny registry variants on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import symbolic_trace

from sublinear.models import (
    MODELS,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    Bottleneck,
    GPT,
    GPTConfig,
    ModelSpec,
    ResNet,
    TINY_BERT_CONFIG,
    get_model,
    resnet18,
    resnet50,
)
from sublinear.models.bert import BertSelfAttention
from sublinear.models.gpt import CausalSelfAttention

TINY = ["tiny-resnet", "tiny-bert", "tiny-gpt"]


# Expected output shape at batch 2 and the spec's default inputs.
EXPECTED_SHAPES = {
    "resnet18": (2, 1000),
    "resnet50": (2, 1000),
    "tiny-resnet": (2, 10),
    "bert-base": (2, 2),
    "bert-base-mlm": (2, 512, 30522),
    "tiny-bert": (2, 2),
    "gpt": (2, 512, 50257),
    "tiny-gpt": (2, 32, 1000),
}


def n_params(model: nn.Module) -> int:
    """Parameter count, shared (tied) parameters counted once."""
    return sum(p.numel() for p in model.parameters())


def build_tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    return get_model(name).build()


def trace(model: nn.Module, name: str) -> torch.fx.GraphModule:
    """symbolic_trace with every optional argument not given fixed to None."""
    concrete = {"attention_mask": None, "token_type_ids": None} if "bert" in name else None
    return symbolic_trace(model, concrete_args=concrete)


# --------------------------------------------------------------------------- registry


def test_registry_names():
    assert set(MODELS) == set(EXPECTED_SHAPES)
    for name, spec in MODELS.items():
        assert isinstance(spec, ModelSpec)
        assert spec.name == name
        assert get_model(name) is spec
        assert spec.description


def test_default_seq():
    assert MODELS["resnet18"].default_seq is None
    assert MODELS["resnet50"].default_seq is None
    assert MODELS["tiny-resnet"].default_seq is None
    assert MODELS["bert-base"].default_seq == 512
    assert MODELS["bert-base-mlm"].default_seq == 512
    assert MODELS["gpt"].default_seq == 512
    assert MODELS["tiny-bert"].default_seq == 32
    assert MODELS["tiny-gpt"].default_seq == 32


def test_get_model_unknown_name():
    with pytest.raises(ValueError) as info:
        get_model("resnet-9000")
    message = str(info.value)
    assert "resnet-9000" in message
    for name in MODELS:
        assert name in message


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODELS["tiny-gpt"].name = "other"  # type: ignore[misc]


def test_builds_do_not_share_config():
    a, b = build_tiny("tiny-bert"), build_tiny("tiny-bert")
    assert a.config is not b.config
    a.config.num_labels = 99
    assert b.config.num_labels == 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_example_inputs_deterministic(name):
    spec = MODELS[name]
    args1, kwargs1 = spec.example_inputs(3)
    args2, kwargs2 = spec.example_inputs(3)
    assert kwargs1 == kwargs2 == {}
    assert len(args1) == len(args2) == 1
    assert torch.equal(args1[0], args2[0])
    x = args1[0]
    assert x.device.type == "cpu"
    if spec.default_seq is None:
        assert x.dtype == torch.float32
        assert x.shape[:2] == (3, 3) and x.shape[2] == x.shape[3]
    else:
        assert x.dtype == torch.long
        assert x.shape == (3, spec.default_seq)
        assert x.min() >= 0
        # Tokens must span the vocabulary, not sit at 0.
        assert x.max() > 0
    (meta,), _ = spec.example_inputs(3, device="meta")
    assert meta.device.type == "meta"
    assert meta.shape == x.shape and meta.dtype == x.dtype


def test_example_inputs_seq_and_sizes():
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2, seq=17)
    assert ids.shape == (2, 17)
    assert int(ids.max()) < 1000
    (ids,), _ = MODELS["gpt"].example_inputs(1, seq=1024, device="meta")
    assert ids.shape == (1, 1024)
    with pytest.raises(ValueError):
        MODELS["tiny-gpt"].example_inputs(2, seq=129)  # block_size is 128
    with pytest.raises(ValueError):
        MODELS["bert-base"].example_inputs(2, seq=513)
    (img,), _ = MODELS["resnet50"].example_inputs(2)
    assert img.shape == (2, 3, 224, 224)
    (img,), _ = MODELS["tiny-resnet"].example_inputs(2)
    assert img.shape == (2, 3, 32, 32)
    with pytest.raises(ValueError):
        MODELS["resnet18"].example_inputs(2, seq=32)


# --------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
    "factory, expected",
    [
        (resnet18, 11_689_512),
        (resnet50, 25_557_032),
        (BertModel, 109_482_240),
        (BertForSequenceClassification, 109_483_778),
        (BertForMaskedLM, 109_514_298),
        # wte 25,731,584 + wpe 524,288 + 6 blocks x 3,152,384 + ln_f 1,024 (lm_head tied).
        (GPT, 45_171_200),
    ],
    ids=["resnet18", "resnet50", "BertModel", "BertForSeqCls", "BertForMaskedLM", "GPT"],
)
def test_parameter_counts(factory, expected):
    with torch.device("meta"):
        model = factory()
    assert n_params(model) == expected


def test_registry_parameter_counts_match_factories():
    with torch.device("meta"):
        assert n_params(MODELS["resnet50"].build()) == 25_557_032
        assert n_params(MODELS["bert-base"].build()) == 109_483_778
        assert n_params(MODELS["bert-base-mlm"].build()) == 109_514_298


def test_build_under_meta_allocates_nothing():
    with torch.device("meta"):
        model = MODELS["gpt"].build()
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.device.type == "meta" for t in tensors)


# --------------------------------------------------------------------------- forward shapes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_on_meta(name):
    spec = MODELS[name]
    with torch.device("meta"):
        model = spec.build()
    args, kwargs = spec.example_inputs(2, device="meta")
    out = model(*args, **kwargs)
    assert out.device.type == "meta"
    assert tuple(out.shape) == EXPECTED_SHAPES[name]


def test_bert_model_outputs():
    torch.manual_seed(0)
    model = BertModel(TINY_BERT_CONFIG).eval()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2, seq=10)
    seq_out, pooled = model(ids)
    assert seq_out.shape == (2, 10, 64)
    assert pooled.shape == (2, 64)
    # The pooler is tanh(dense(first token)).
    expected = torch.tanh(model.pooler.dense(seq_out[:, 0]))
    torch.testing.assert_close(pooled, expected)
    _, no_pool = BertModel(TINY_BERT_CONFIG, add_pooling_layer=False)(ids)
    assert no_pool is None


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", TINY)
def test_tiny_train_backward(name):
    spec = MODELS[name]
    model = build_tiny(name).train()
    args, kwargs = spec.example_inputs(2)
    out = model(*args, **kwargs)
    assert tuple(out.shape) == EXPECTED_SHAPES[name]
    assert torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    # Every parameter takes part in the loss.
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gpt"])
def test_dropout_active_only_in_train(name):
    spec = MODELS[name]
    model = build_tiny(name)
    args, kwargs = spec.example_inputs(2)
    model.train()
    assert not torch.equal(model(*args, **kwargs), model(*args, **kwargs))
    model.eval()
    assert torch.equal(model(*args, **kwargs), model(*args, **kwargs))


def test_batchnorm_active_in_train():
    spec = MODELS["tiny-resnet"]
    model = build_tiny("tiny-resnet")
    (x,), _ = spec.example_inputs(2)
    bn = model.bn1
    assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    model.train()
    train_out = model(x)
    # Train mode updates the running statistics...
    assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    model.eval()
    # ...and normalises with batch statistics, unlike eval mode.
    eval_out = model(x)
    assert not torch.allclose(train_out, eval_out)
    assert torch.equal(eval_out, model(x))


# --------------------------------------------------------------------------- torch.fx


@pytest.mark.parametrize("name", TINY)
def test_symbolic_trace_matches_eager(name):
    spec = MODELS[name]
    model = build_tiny(name).eval()
    gm = trace(model, name)
    args, kwargs = spec.example_inputs(2)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        actual = gm(*args, **kwargs)
    assert torch.equal(actual, expected)
    # A different sequence length must go through the same graph.
    if spec.default_seq is not None:
        args, kwargs = spec.example_inputs(3, seq=spec.default_seq // 2 + 1)
        with torch.no_grad():
            assert torch.equal(gm(*args, **kwargs), model(*args, **kwargs))


def test_symbolic_trace_bert_mlm():
    torch.manual_seed(0)
    model = BertForMaskedLM(TINY_BERT_CONFIG).eval()
    gm = symbolic_trace(model, concrete_args={"attention_mask": None, "token_type_ids": None})
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    with torch.no_grad():
        out = gm(ids)
        assert out.shape == (2, 32, 1000)
        assert torch.equal(out, model(ids))


def _count_adds(gm: torch.fx.GraphModule) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if (n.op == "call_function" and n.target in (operator.add, torch.add))
    )


def test_symbolic_trace_bert_with_mask_and_token_types():
    model = build_tiny("tiny-bert").eval()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0
    types = torch.zeros_like(ids)
    types[:, 16:] = 1
    gm_masked = symbolic_trace(model, concrete_args={"token_type_ids": None})
    gm_full = symbolic_trace(model)
    gm_plain = trace(model, "tiny-bert")
    with torch.no_grad():
        assert torch.equal(gm_masked(ids, mask), model(ids, mask))
        assert torch.equal(gm_full(ids, mask, types), model(ids, mask, types))
    # Without a mask no mask is built or added: one add per layer fewer.
    assert _count_adds(gm_masked) - _count_adds(gm_plain) == TINY_BERT_CONFIG.num_hidden_layers


# --------------------------------------------------------------------------- semantics


def test_bert_attention_mask_hides_padding():
    model = build_tiny("tiny-bert").bert.eval()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    mask = torch.ones_like(ids)
    mask[:, 24:] = 0
    changed = ids.clone()
    changed[:, 24:] = (changed[:, 24:] + 1) % 1000
    with torch.no_grad():
        a, _ = model(ids, mask)
        b, _ = model(changed, mask)
        c, _ = model(changed)
    torch.testing.assert_close(a[:, :24], b[:, :24], rtol=0, atol=1e-6)
    # Without the mask the change leaks into the kept positions.
    assert not torch.allclose(a[:, :24], c[:, :24], atol=1e-4)


def test_bert_token_types():
    model = build_tiny("tiny-bert").bert.eval()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    with torch.no_grad():
        default, _ = model(ids)
        zeros, _ = model(ids, token_type_ids=torch.zeros_like(ids))
        ones, _ = model(ids, token_type_ids=torch.ones_like(ids))
        all_ones_mask, _ = model(ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(default, zeros)
    assert not torch.allclose(default, ones)
    torch.testing.assert_close(default, all_ones_mask)


def test_bert_attention_matches_sdpa():
    torch.manual_seed(0)
    attn = BertSelfAttention(TINY_BERT_CONFIG).eval()
    x = torch.randn(2, 9, 64)
    keep = torch.ones(2, 9)
    keep[1, 5:] = 0
    additive = (1.0 - keep[:, None, None, :]) * -10000.0

    def heads(t):
        return t.view(2, 9, 2, 32).transpose(1, 2)

    with torch.no_grad():
        ref = F.scaled_dot_product_attention(
            heads(attn.query(x)), heads(attn.key(x)), heads(attn.value(x)), attn_mask=additive
        )
        out = attn(x, additive)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(2, 9, 64))


def test_gpt_attention_matches_sdpa():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.0)
    attn = CausalSelfAttention(cfg).eval()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        q, k, v = attn.c_attn(x).split(32, dim=2)
        q, k, v = (t.view(2, 11, 4, 8).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = attn.c_proj(y.transpose(1, 2).reshape(2, 11, 32))
        out = attn(x)
    torch.testing.assert_close(out, ref)


def test_gpt_is_causal():
    model = build_tiny("tiny-gpt").eval()
    (ids,), _ = MODELS["tiny-gpt"].example_inputs(2)
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 1000
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_gpt_rejects_sequences_past_block_size():
    model = build_tiny("tiny-gpt").eval()
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 129, dtype=torch.long))


def _reference_bert(model: BertModel, ids: torch.Tensor, keep: torch.Tensor | None):
    """BERT written directly with torch.nn.functional from ``model``'s weights."""
    cfg = model.config
    emb = model.embeddings
    B, S = ids.shape
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    d = H // nh

    def ln(x, mod):
        return F.layer_norm(x, (H,), mod.weight, mod.bias, cfg.layer_norm_eps)

    def lin(x, mod):
        return x @ mod.weight.T + mod.bias

    def heads(x):
        return x.reshape(B, S, nh, d).transpose(1, 2)

    x = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:S]
    x = x + emb.token_type_embeddings.weight[0]
    x = ln(x, emb.LayerNorm)
    additive = 0.0 if keep is None else (1.0 - keep[:, None, None, :].float()) * -10000.0
    for layer in model.encoder.layer:
        att = layer.attention.self
        scores = heads(lin(x, att.query)) @ heads(lin(x, att.key)).transpose(-1, -2) / math.sqrt(d)
        ctx = torch.softmax(scores + additive, dim=-1) @ heads(lin(x, att.value))
        ctx = ctx.transpose(1, 2).reshape(B, S, H)
        x = ln(lin(ctx, layer.attention.output.dense) + x, layer.attention.output.LayerNorm)
        inter = F.gelu(lin(x, layer.intermediate.dense))
        x = ln(lin(inter, layer.output.dense) + x, layer.output.LayerNorm)
    pooled = torch.tanh(lin(x[:, 0], model.pooler.dense))
    return x, pooled


def test_bert_matches_functional_reference():
    model = build_tiny("tiny-bert").eval()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    keep = torch.ones_like(ids)
    keep[1, 10:] = 0
    with torch.no_grad():
        for mask in (None, keep):
            seq, pooled = model.bert(ids, mask)
            ref_seq, ref_pooled = _reference_bert(model.bert, ids, mask)
            torch.testing.assert_close(seq, ref_seq)
            torch.testing.assert_close(pooled, ref_pooled)
            logits = model(ids, mask)
            ref_logits = ref_pooled @ model.classifier.weight.T + model.classifier.bias
            torch.testing.assert_close(logits, ref_logits)
    mlm = BertForMaskedLM(TINY_BERT_CONFIG).eval()
    with torch.no_grad():
        seq, _ = mlm.bert(ids)
        head = mlm.cls.predictions
        t = F.layer_norm(
            F.gelu(seq @ head.transform.dense.weight.T + head.transform.dense.bias),
            (64,),
            head.transform.LayerNorm.weight,
            head.transform.LayerNorm.bias,
            1e-12,
        )
        ref = t @ mlm.bert.embeddings.word_embeddings.weight.T + head.decoder.bias
        torch.testing.assert_close(mlm(ids), ref)


def test_gpt_matches_functional_reference():
    model = build_tiny("tiny-gpt").eval()
    (ids,), _ = MODELS["tiny-gpt"].example_inputs(2)
    B, T = ids.shape
    C, nh = 64, 2

    def ln(x, mod):
        return F.layer_norm(x, (C,), mod.weight, mod.bias, 1e-5)

    def lin(x, mod):
        return x @ mod.weight.T + (0 if mod.bias is None else mod.bias)

    tr = model.transformer
    x = tr.wte.weight[ids] + tr.wpe.weight[:T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for block in tr.h:
        q, k, v = lin(ln(x, block.ln_1), block.attn.c_attn).split(C, dim=2)
        q, k, v = (t.reshape(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(C // nh)).masked_fill(future, float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + lin(y, block.attn.c_proj)
        x = x + lin(F.gelu(lin(ln(x, block.ln_2), block.mlp.c_fc)), block.mlp.c_proj)
    ref = ln(x, tr.ln_f) @ tr.wte.weight.T
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref.detach())


def _dropouts_called(model: nn.Module, *args) -> list[str]:
    """Names of the nn.Dropout modules run by one forward, in call order."""
    called: list[str] = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, name=name: called.append(name))
        for name, m in model.named_modules()
        if isinstance(m, nn.Dropout)
    ]
    try:
        model(*args)
    finally:
        for h in hooks:
            h.remove()
    return called


def test_dropout_placement():
    bert = build_tiny("tiny-bert").train()
    (ids,), _ = MODELS["tiny-bert"].example_inputs(2)
    expected = ["bert.embeddings.dropout"]
    for i in range(TINY_BERT_CONFIG.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        for suffix in ("attention.self.dropout", "attention.output.dropout", "output.dropout"):
            expected.append(p + suffix)
    expected.append("dropout")
    assert _dropouts_called(bert, ids) == expected
    assert all(m.p == 0.1 for m in bert.modules() if isinstance(m, nn.Dropout))

    gpt = build_tiny("tiny-gpt").train()
    expected = ["transformer.drop"]
    for i in range(2):
        p = f"transformer.h.{i}."
        expected += [p + "attn.attn_dropout", p + "attn.resid_dropout", p + "mlp.dropout"]
    assert _dropouts_called(gpt, ids) == expected
    assert all(m.p == 0.1 for m in gpt.modules() if isinstance(m, nn.Dropout))


def test_example_inputs_use_generator_seeded_zero():
    (ids,), _ = MODELS["tiny-gpt"].example_inputs(2, seq=8)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(ids, torch.randint(0, 1000, (2, 8), generator=g))
    (img,), _ = MODELS["tiny-resnet"].example_inputs(2)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(img, torch.randn(2, 3, 32, 32, generator=g))


# --------------------------------------------------------------------------- structure and init


def test_weight_tying():
    mlm = BertForMaskedLM(TINY_BERT_CONFIG)
    assert mlm.cls.predictions.decoder.weight is mlm.bert.embeddings.word_embeddings.weight
    assert mlm.bert.pooler is None
    gpt = build_tiny("tiny-gpt")
    assert gpt.lm_head.weight is gpt.transformer.wte.weight


def test_non_persistent_buffers():
    bert_sd = BertForSequenceClassification(TINY_BERT_CONFIG).state_dict()
    assert not any("position_ids" in k for k in bert_sd)
    gpt = build_tiny("tiny-gpt")
    assert not any("tril" in k or "position_ids" in k for k in gpt.state_dict())
    buffers = dict(gpt.named_buffers())
    tril = buffers["transformer.h.0.attn.tril"]
    assert tril.dtype == torch.bool and tril.shape == (1, 1, 128, 128)
    assert torch.equal(tril[0, 0], torch.ones(128, 128, dtype=torch.bool).tril())


def test_hf_and_torchvision_names():
    bert_keys = set(BertForSequenceClassification(TINY_BERT_CONFIG).state_dict())
    for key in [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.encoder.layer.1.attention.self.query.weight",
        "bert.encoder.layer.1.attention.self.key.bias",
        "bert.encoder.layer.1.attention.self.value.weight",
        "bert.encoder.layer.1.attention.output.dense.weight",
        "bert.encoder.layer.1.attention.output.LayerNorm.bias",
        "bert.encoder.layer.1.intermediate.dense.weight",
        "bert.encoder.layer.1.output.dense.weight",
        "bert.encoder.layer.1.output.LayerNorm.weight",
        "bert.pooler.dense.weight",
        "classifier.weight",
    ]:
        assert key in bert_keys, key
    mlm_keys = set(BertForMaskedLM(TINY_BERT_CONFIG).state_dict())
    for key in [
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.decoder.weight",
        "cls.predictions.decoder.bias",
    ]:
        assert key in mlm_keys, key
    with torch.device("meta"):
        r50 = set(resnet50().state_dict())
    for key in [
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.downsample.0.weight",
        "layer1.0.downsample.1.num_batches_tracked",
        "layer4.2.conv3.weight",
        "layer4.2.bn3.running_mean",
        "fc.bias",
    ]:
        assert key in r50, key
    assert "layer1.1.downsample.0.weight" not in r50


def test_resnet50_is_v1_5():
    with torch.device("meta"):
        model = resnet50()
    first = model.layer2[0]
    assert isinstance(first, Bottleneck)
    assert first.conv1.stride == (1, 1)
    assert first.conv2.stride == (2, 2)
    assert first.downsample[0].stride == (2, 2)
    stages = (model.layer1, model.layer2, model.layer3, model.layer4)
    assert [len(s) for s in stages] == [3, 4, 6, 3]
    assert isinstance(model.relu, nn.ReLU) and model.relu.inplace


def test_resnet_stage_shapes():
    """torchvision's feature-map sizes for a 224x224 input (stride 4 stem, then /2 per stage)."""
    with torch.device("meta"):
        model = resnet50()
    shapes = {}
    for name in ["maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"]:
        getattr(model, name).register_forward_hook(
            lambda mod, inp, out, name=name: shapes.__setitem__(name, tuple(out.shape))
        )
    (x,), _ = MODELS["resnet50"].example_inputs(2, device="meta")
    model(x)
    assert shapes == {
        "maxpool": (2, 64, 56, 56),
        "layer1": (2, 256, 56, 56),
        "layer2": (2, 512, 28, 28),
        "layer3": (2, 1024, 14, 14),
        "layer4": (2, 2048, 7, 7),
        "avgpool": (2, 2048, 1, 1),
    }


def test_resnet_init():
    torch.manual_seed(0)
    model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)
    # kaiming_normal_(fan_out, relu): std = sqrt(2 / (out_channels * kh * kw)).
    w = model.conv1.weight
    assert abs(w.std().item() / math.sqrt(2 / (64 * 7 * 7)) - 1) < 0.05
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
    zero = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, zero_init_residual=True)
    assert torch.equal(zero.layer1[0].bn3.weight, torch.zeros(256))
    assert torch.equal(zero.layer1[0].bn1.weight, torch.ones(64))


def test_resnet_dilation():
    model = resnet18(num_classes=10).eval()
    dilated = ResNet(
        Bottleneck, [1, 1, 1, 2], num_classes=10, replace_stride_with_dilation=[False, True, True]
    )
    # As in torchvision: a stage's first block keeps the previous dilation.
    assert dilated.layer3[0].conv2.dilation == (1, 1)
    assert dilated.layer4[0].conv2.dilation == (2, 2)
    assert dilated.layer4[1].conv2.dilation == (4, 4)
    assert dilated.layer4[0].conv2.stride == (1, 1)
    assert dilated(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError):
        ResNet(Bottleneck, [1, 1, 1, 1], replace_stride_with_dilation=[True])
    with pytest.raises(ValueError):
        resnet18(width_per_group=32)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_bert_init():
    torch.manual_seed(0)
    model = BertForMaskedLM(TINY_BERT_CONFIG)
    emb = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(emb[0], torch.zeros(64))  # padding row
    assert abs(emb[1:].std().item() - 0.02) < 0.002
    for m in model.modules():
        if isinstance(m, nn.Linear):
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
            assert abs(m.weight.std().item() - 0.02) < 0.003
        elif isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert m.eps == 1e-12
    assert isinstance(model.bert.encoder.layer[0].intermediate.intermediate_act_fn, nn.GELU)
    assert model.bert.encoder.layer[0].intermediate.intermediate_act_fn.approximate == "none"


def test_bert_config_validation():
    with pytest.raises(ValueError):
        BertConfig(hidden_size=100, num_attention_heads=12)
    with pytest.raises(ValueError):
        GPTConfig(n_embd=100, n_head=8)
    with pytest.raises(ValueError):
        BertModel(BertConfig(hidden_size=64, num_attention_heads=2, hidden_act="swishy"))
