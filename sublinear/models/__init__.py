"""Built-in model zoo: a name -> ``ModelSpec`` registry of reference models.

Invariants:

* ``spec.build()`` constructs the model on the current default device, so
  ``with torch.device("meta"): spec.build()`` allocates no storage.
* ``spec.example_inputs(batch, device=..., seq=...)`` returns ``(args, kwargs)``
  for ``model(*args, **kwargs)``. Inputs are deterministic: they are drawn on
  CPU from a ``torch.Generator`` seeded 0 and then moved to ``device``; for
  ``device="meta"`` they are uninitialised meta tensors of the same shape and
  dtype. Text models take ``int64`` token ids ``[batch, seq]`` (``seq``
  defaults to ``spec.default_seq``); image models take ``float32`` images
  ``[batch, 3, H, W]`` and reject ``seq``.

``get_model("hf:<ModelClass>")`` also gives any transformers model class from its default config
(:func:`sublinear.models.hf.hf_model`, whose inputs are keyword arguments with labels).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

from sublinear.models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from sublinear.models.gpt import GPT, GPTConfig
from sublinear.models.random_dag import RandomDAG
from sublinear.models.resnet import Bottleneck, BasicBlock, ResNet, resnet18, resnet50

__all__ = [
    "ModelSpec",
    "MODELS",
    "get_model",
    "BertConfig",
    "BertModel",
    "BertForSequenceClassification",
    "BertForMaskedLM",
    "TINY_BERT_CONFIG",
    "GPTConfig",
    "GPT",
    "ResNet",
    "BasicBlock",
    "Bottleneck",
    "resnet18",
    "resnet50",
    "RandomDAG",
]


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it and how to make inputs for it."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[..., tuple[tuple, dict]]
    default_seq: Optional[int]


def _seeded(
    device: str | torch.device, make: Callable[[torch.Generator], torch.Tensor]
) -> torch.Tensor:
    """``make(generator seeded 0)`` on CPU, then moved to ``device``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    return make(g).to(device)


def _image_inputs(
    batch: int,
    *,
    device: str | torch.device = "cpu",
    seq: Optional[int] = None,
    size: int,
) -> tuple[tuple, dict]:
    """``([batch, 3, size, size] float32,), {}``."""
    if seq is not None:
        raise ValueError(f"image models take no sequence length (got seq={seq})")
    shape = (batch, 3, size, size)
    if torch.device(device).type == "meta":
        return (torch.empty(shape, dtype=torch.float32, device="meta"),), {}
    return (_seeded(device, lambda g: torch.randn(shape, generator=g)),), {}


def _token_inputs(
    batch: int,
    *,
    device: str | torch.device = "cpu",
    seq: Optional[int] = None,
    vocab_size: int,
    default_seq: int,
    max_seq: int,
) -> tuple[tuple, dict]:
    """``([batch, seq] int64 token ids in [0, vocab_size),), {}``."""
    seq = default_seq if seq is None else seq
    if not 1 <= seq <= max_seq:
        raise ValueError(f"seq must be in [1, {max_seq}] for this model, got {seq}")
    shape = (batch, seq)
    if torch.device(device).type == "meta":
        return (torch.empty(shape, dtype=torch.long, device="meta"),), {}
    return (_seeded(device, lambda g: torch.randint(0, vocab_size, shape, generator=g)),), {}


def _image_spec(
    name: str, description: str, build: Callable[[], nn.Module], size: int
) -> ModelSpec:
    return ModelSpec(name, description, build, partial(_image_inputs, size=size), None)


def _text_spec(
    name: str,
    description: str,
    build: Callable[[], nn.Module],
    vocab_size: int,
    default_seq: int,
    max_seq: int,
) -> ModelSpec:
    inputs = partial(_token_inputs, vocab_size=vocab_size, default_seq=default_seq, max_seq=max_seq)
    return ModelSpec(name, description, build, inputs, default_seq)


def _with_config(model_cls: Callable[..., nn.Module], config) -> Callable[[], nn.Module]:
    """A builder that gives each model its own copy of ``config``."""

    def build() -> nn.Module:
        return model_cls(replace(config))

    build.__qualname__ = build.__name__ = f"build_{model_cls.__name__}"
    return build


_BERT_BASE = BertConfig()
TINY_BERT_CONFIG = BertConfig(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
)
_GPT = GPTConfig()
_TINY_GPT = GPTConfig(vocab_size=1000, block_size=128, n_layer=2, n_head=2, n_embd=64)

_SPECS = [
    _image_spec("resnet18", "torchvision ResNet-18, 224x224 images, 1000 classes", resnet18, 224),
    _image_spec(
        "resnet50", "torchvision ResNet-50 v1.5, 224x224 images, 1000 classes", resnet50, 224
    ),
    _image_spec(
        "tiny-resnet",
        "ResNet(Bottleneck, [1, 1, 1, 1]), 32x32 images, 10 classes",
        partial(ResNet, Bottleneck, [1, 1, 1, 1], num_classes=10),
        32,
    ),
    _text_spec(
        "bert-base",
        "BERT-base sequence classifier (2 labels), token ids -> logits [B, 2]",
        _with_config(BertForSequenceClassification, _BERT_BASE),
        _BERT_BASE.vocab_size,
        512,
        _BERT_BASE.max_position_embeddings,
    ),
    _text_spec(
        "bert-base-mlm",
        "BERT-base masked LM, token ids -> logits [B, S, 30522]",
        _with_config(BertForMaskedLM, _BERT_BASE),
        _BERT_BASE.vocab_size,
        512,
        _BERT_BASE.max_position_embeddings,
    ),
    _text_spec(
        "tiny-bert",
        "2-layer BERT classifier (hidden 64, 2 heads, vocab 1000)",
        _with_config(BertForSequenceClassification, TINY_BERT_CONFIG),
        TINY_BERT_CONFIG.vocab_size,
        32,
        TINY_BERT_CONFIG.max_position_embeddings,
    ),
    _text_spec(
        "gpt",
        "GPT-2-style decoder (6 layers, 512 wide, 8 heads), token ids -> logits [B, T, 50257]",
        _with_config(GPT, _GPT),
        _GPT.vocab_size,
        512,
        _GPT.block_size,
    ),
    _text_spec(
        "tiny-gpt",
        "2-layer GPT (n_embd 64, 2 heads, vocab 1000, block 128)",
        _with_config(GPT, _TINY_GPT),
        _TINY_GPT.vocab_size,
        32,
        _TINY_GPT.block_size,
    ),
]

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}


def get_model(name: str) -> ModelSpec:
    """A registered model, or ``hf:<ModelClass>`` (:func:`sublinear.models.hf.hf_model` with its defaults; needs
    transformers); raises ``ValueError`` naming the valid choices."""
    if name.startswith("hf:"):
        from sublinear.models.hf import hf_model

        return hf_model(name[len("hf:"):])
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}, or hf:<ModelClass> "
            "(a transformers class, e.g. hf:GPT2LMHeadModel)"
        ) from None
