"""BERT, written from scratch to mirror Hugging Face ``transformers``' eager BERT.

Invariants (checked by ``tests/test_models.py``):

* Module and parameter names follow HF (``embeddings.word_embeddings``,
  ``encoder.layer.N.attention.self.query``, ``cls.predictions.decoder``, ...),
  so HF state dicts load with at most a prefix change.
* ``BertModel(BertConfig())`` has 109,482,240 parameters (bert-base-uncased);
  ``BertForSequenceClassification`` 109,483,778; ``BertForMaskedLM``
  109,514,298 (tied decoder weight counted once, no pooler, as in HF).
* Attention is eager: ``softmax(QK^T / sqrt(d) + mask)`` then dropout, then ``@ V``.
* Every ``forward`` is traceable by ``torch.fx.symbolic_trace`` with optional
  arguments that are not given passed as ``concrete_args={name: None}``:
  the only Python branches are ``is None`` tests on arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertSelfAttention",
    "BertLayer",
    "BertEncoder",
    "BertPooler",
    "BertModel",
    "BertForSequenceClassification",
    "BertForMaskedLM",
]

# Additive value for masked-out keys. HF used -10000.0 for years; unlike
# ``finfo(float32).min`` it is representable in fp16/bf16 (no -inf, no NaN on
# fully masked rows) and needs no dtype lookup, which keeps forward traceable.
MASK_VALUE = -10000.0


def _activation(name: str) -> nn.Module:
    """HF activation names -> modules. ``"gelu"`` is the exact erf GELU."""
    acts = {
        "gelu": lambda: nn.GELU(),
        "gelu_new": lambda: nn.GELU(approximate="tanh"),
        "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
        "relu": lambda: nn.ReLU(),
        "tanh": lambda: nn.Tanh(),
    }
    if name not in acts:
        raise ValueError(f"unknown hidden_act {name!r}; expected one of {sorted(acts)}")
    return acts[name]()


@dataclass
class BertConfig:
    """Hyper-parameters; the defaults are bert-base-uncased."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    num_labels: int = 2
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # [1, max_position_embeddings]; narrowed to the sequence length in forward
        # (``torch.narrow`` rather than ``[:, :n]``: fx does not proxy buffers, and
        # a plain tensor cannot be sliced by a traced length).
        self.register_buffer(
            "position_ids",
            torch.arange(config.max_position_embeddings).expand((1, -1)),
            persistent=False,
        )

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        seq_length = input_ids.size(1)
        position_ids = torch.narrow(self.position_ids, 1, 0, seq_length)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        embeddings = self.word_embeddings(input_ids)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class BertSelfAttention(nn.Module):
    """Multi-head eager attention with separate query/key/value projections."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def _split_heads(self, x: Tensor) -> Tensor:
        """[B, S, H*D] -> [B, H, S, D]."""
        x = x.unflatten(-1, (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        query_layer = self._split_heads(self.query(hidden_states))
        key_layer = self._split_heads(self.key(hidden_states))
        value_layer = self._split_heads(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Additive [B, 1, 1, S] mask: 0 where attended, MASK_VALUE elsewhere.
            attention_scores = attention_scores + attention_mask

        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        # [B, H, S, D] -> [B, S, H*D]
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous().flatten(2)
        return context_layer


class BertAttention(nn.Module):
    """Self-attention followed by its output projection and residual."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertOutput(config, config.hidden_size)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        self_outputs = self.self(hidden_states, attention_mask)
        return self.output(self_outputs, hidden_states)


class BertIntermediate(nn.Module):
    """dense (hidden -> intermediate) -> activation."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = _activation(config.hidden_act)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    """dense (``in_features`` -> hidden) -> dropout -> residual add -> LayerNorm (post-LN); closes both the
    attention block (``in_features`` = hidden) and the feed-forward block (``in_features`` = intermediate)."""

    def __init__(self, config: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertLayer(nn.Module):
    """One post-LN transformer layer: attention block then feed-forward block."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config, config.intermediate_size)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class BertEncoder(nn.Module):
    """A stack of ``num_hidden_layers`` ``BertLayer``s."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class BertPooler(nn.Module):
    """dense + tanh on the first ([CLS]) token."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        first_token_tensor = hidden_states[:, 0]
        return self.activation(self.dense(first_token_tensor))


def _init_bert_weights(module: nn.Module, config: BertConfig) -> None:
    """HF ``BertPreTrainedModel._init_weights``: N(0, initializer_range), zero bias,
    zero padding row, LayerNorm weight 1 / bias 0. Call before tying weights."""
    std = config.initializer_range
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _extended_attention_mask(attention_mask: Tensor, like: Tensor) -> Tensor:
    """[B, S] mask of 1 (attend) / 0 (ignore) -> additive [B, 1, 1, S] in ``like``'s dtype."""
    mask = attention_mask[:, None, None, :].type_as(like)
    return (1.0 - mask) * MASK_VALUE


class BertModel(nn.Module):
    """Embeddings + encoder (+ optional pooler).

    ``forward(input_ids [B, S] long, attention_mask [B, S] | None,
    token_type_ids [B, S] | None)`` returns ``(sequence_output [B, S, H],
    pooled_output [B, H] or None without a pooler)``. A ``None`` mask adds
    nothing to the attention scores; ``None`` token types mean all zeros.
    """

    def __init__(self, config: Optional[BertConfig] = None, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = config = config if config is not None else BertConfig()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        _init_bert_weights(self, config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        embedding_output = self.embeddings(input_ids, token_type_ids)
        extended_mask = None
        if attention_mask is not None:
            extended_mask = _extended_attention_mask(attention_mask, embedding_output)
        sequence_output = self.encoder(embedding_output, extended_mask)
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        return sequence_output, pooled_output


class BertForSequenceClassification(nn.Module):
    """BertModel -> dropout(pooled) -> Linear(hidden, num_labels); logits [B, num_labels]."""

    def __init__(self, config: Optional[BertConfig] = None) -> None:
        super().__init__()
        self.config = config = config if config is not None else BertConfig()
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        _init_bert_weights(self.classifier, config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
    ) -> Tensor:
        _, pooled_output = self.bert(input_ids, attention_mask, token_type_ids)
        pooled_output = self.dropout(pooled_output)
        return self.classifier(pooled_output)


class BertPredictionHeadTransform(nn.Module):
    """dense -> activation -> LayerNorm, applied to every position before decoding."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: Tensor) -> Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        return self.LayerNorm(hidden_states)


class BertLMPredictionHead(nn.Module):
    """Transform, then ``decoder`` (weight tied by the owner, own output bias)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden_states))


class BertOnlyMLMHead(nn.Module):
    """Wrapper that gives the HF name ``cls.predictions``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, sequence_output: Tensor) -> Tensor:
        return self.predictions(sequence_output)


class BertForMaskedLM(nn.Module):
    """BertModel without pooler -> MLM head; returns logits [B, S, vocab_size].

    ``cls.predictions.decoder.weight`` *is* ``bert.embeddings.word_embeddings.weight``.
    """

    def __init__(self, config: Optional[BertConfig] = None) -> None:
        super().__init__()
        self.config = config = config if config is not None else BertConfig()
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        _init_bert_weights(self.cls, config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
    ) -> Tensor:
        sequence_output, _ = self.bert(input_ids, attention_mask, token_type_ids)
        return self.cls(sequence_output)
