"""Hugging Face ``transformers`` models as :class:`ModelSpec`: ``hf:<ModelClass>`` on the command line.

Invariants (besides those of :class:`ModelSpec`):

* The model is ``ModelClass(ModelClass.config_class(**overrides))``: the class's default config, randomly
  initialised, nothing downloaded. Every build gets its own copy of the config. ``use_cache`` is off (a training
  step keeps no KV cache, as transformers does itself under gradient checkpointing), so every strategy runs the
  same step.
* ``example_inputs`` returns ``((), kwargs)``. Text models (``main_input_name == "input_ids"``) take ``input_ids``
  ``[batch, seq]`` int64 in ``[0, vocab_size)`` and an ``attention_mask`` of ones; vision models
  (``"pixel_values"``) take float32 images ``[batch, num_channels, image_size, image_size]`` and reject ``seq``.
  ``labels`` are added when the class computes a loss from them: ``[batch]`` class ids for sequence and image
  classification, ``[batch, seq]`` class ids for token classification, a copy of the input ids for causal and
  masked LMs, and ``[batch, seq]`` decoder token ids for encoder-decoder generation (T5, BART).
* ``default_seq`` is 1024 for causal LMs and 512 otherwise, capped at the config's maximum positions.

transformers is imported when a spec is made, never when this module is imported.
"""

from __future__ import annotations

import copy
import inspect
from typing import Optional

import torch

from sublinear.models import ModelSpec

__all__ = ["hf_model"]

PREFIX = "hf:"
ATTENTION = ("eager", "sdpa")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
ONE_LABEL_SUFFIXES = ("ForSequenceClassification", "ForImageClassification")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_INTERMEDIATE = ("intermediate_size", "n_inner", "d_ff")
_HEADS = ("num_attention_heads", "n_head", "num_heads")


def hf_model(class_name: str, *, layers: Optional[int] = None, hidden: Optional[int] = None,
             attn: str = "eager") -> ModelSpec:
    """The spec of ``transformers.<class_name>`` from its default config, named ``hf:<class_name>`` followed by
    the sizes given (``hf:LlamaForCausalLM layers=16 hidden=2048``). ``layers`` overrides the number of
    layers; ``hidden`` the hidden size, with the intermediate size scaled by the default ratio and the head count
    chosen to divide it (the default head width when it divides, else the most heads up to the default);
    ``attn`` is the ``attn_implementation``. Raises ``ValueError`` naming the class for anything it cannot do."""
    name = f"{PREFIX}{class_name}"
    model_class = _model_class(class_name)
    if attn not in ATTENTION:
        raise ValueError(f"{name}: --attn takes {' or '.join(ATTENTION)}, got {attn!r}")
    default = model_class.config_class()
    overrides: dict[str, object] = {"attn_implementation": attn}
    if hasattr(default, "use_cache"):
        overrides["use_cache"] = False
    if layers is not None:
        overrides.update(_layer_override(default, layers, name))
    if hidden is not None:
        overrides.update(_hidden_overrides(default, hidden, name))
    try:
        config = model_class.config_class(**overrides)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: the config refuses {overrides}: {_one_line(exc)}") from None
    labels = _label_kind(model_class, config)
    if labels == "class" and getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0  # decoder classifiers find each sequence's last token through the pad token
    if labels == "decoder-ids" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id  # T5's: labels shifted right start with the pad token

    input_name = model_class.main_input_name
    if input_name == "pixel_values":
        inputs = _VisionInputs(config, labels)
        default_seq = None
    elif input_name == "input_ids":
        max_seq = _max_positions(config)
        default_seq = 1024 if class_name.endswith(CAUSAL_SUFFIXES) else 512
        default_seq = min(default_seq, max_seq) if max_seq else default_seq
        inputs = _TextInputs(config, labels, max_seq, default_seq,
                             "attention_mask" in _forward_parameters(model_class))
    else:
        raise ValueError(f"{name} takes {input_name!r}; hf: makes token ids and images only (write a "
                         "package.module:factory for other inputs)")
    sized = "".join(f" {key}={value}" for key, value in (("layers", layers), ("hidden", hidden)) if value)
    description = f"transformers {class_name}, default {type(config).__name__}{sized}, random init"
    return ModelSpec(name + sized, description, _Builder(model_class, config, name), inputs, default_seq)


def _model_class(class_name: str) -> type:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{PREFIX}{class_name} needs transformers (pip install 'sublinear[hf]')") from None
    model_class = getattr(transformers, class_name, None) if class_name.isidentifier() else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise ValueError(f"{PREFIX}{class_name}: transformers has no model class {class_name!r} "
                         "(e.g. hf:BertForSequenceClassification, hf:GPT2LMHeadModel, hf:LlamaForCausalLM)")
    return model_class


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _real_name(config, names: tuple[str, ...]) -> Optional[str]:
    """The first of ``names`` the config has, as the config stores it (through its ``attribute_map``)."""
    for generic in names:
        real = config.attribute_map.get(generic, generic)
        if hasattr(config, real):
            return real
    return None


def _layer_override(config, layers: int, name: str) -> dict[str, int]:
    attribute = _real_name(config, _LAYERS)
    if attribute is None:
        raise ValueError(f"{name}: --layers: {type(config).__name__} has none of {', '.join(_LAYERS)}")
    if layers < 1:
        raise ValueError(f"{name}: --layers must be >= 1, got {layers}")
    return {attribute: layers}


def _hidden_overrides(config, hidden: int, name: str) -> dict[str, int]:
    """Hidden size, intermediate size at the default ratio, and a head count dividing the hidden size (key-value
    heads dividing that)."""
    hidden_name, heads_name = _real_name(config, _HIDDEN), _real_name(config, _HEADS)
    if hidden_name is None:
        raise ValueError(f"{name}: --hidden: {type(config).__name__} has none of {', '.join(_HIDDEN)}")
    if hidden < 1:
        raise ValueError(f"{name}: --hidden must be >= 1, got {hidden}")
    old_hidden = getattr(config, hidden_name)
    overrides = {hidden_name: hidden}
    intermediate_name = _real_name(config, _INTERMEDIATE)
    if intermediate_name is not None and getattr(config, intermediate_name) is not None:
        overrides[intermediate_name] = max(1, round(getattr(config, intermediate_name) * hidden / old_hidden))
    if heads_name is not None:
        old_heads = getattr(config, heads_name)
        width = old_hidden // old_heads
        heads = hidden // width if hidden % width == 0 else _largest_divisor(hidden, old_heads)
        overrides[heads_name] = heads
        old_kv = getattr(config, "num_key_value_heads", None)
        if old_kv is not None and old_kv != old_heads:
            overrides["num_key_value_heads"] = _largest_divisor(heads, old_kv)
    return overrides


def _largest_divisor(n: int, at_most: int) -> int:
    return next(d for d in range(min(n, at_most), 0, -1) if n % d == 0)


def _max_positions(config) -> Optional[int]:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _forward_parameters(model_class: type) -> set[str]:
    return set(inspect.signature(model_class.forward).parameters)


def _label_kind(model_class: type, config) -> Optional[str]:
    """What ``labels`` the class takes: "class" ([batch]), "token-class" ([batch, seq] class ids), "input-ids" (a
    copy of the input ids), "decoder-ids" ([batch, seq] token ids), or None (no labels: the outputs are summed)."""
    name = model_class.__name__
    if "labels" not in _forward_parameters(model_class):
        return None
    if name.endswith(ONE_LABEL_SUFFIXES):
        return "class"
    if name.endswith("ForTokenClassification"):
        return "token-class"
    if config.is_encoder_decoder and name.endswith("ForConditionalGeneration"):
        return "decoder-ids"
    if name.endswith(CAUSAL_SUFFIXES + ("ForMaskedLM",)):
        return "input-ids"
    return None


class _Builder:
    """``build()``: the model on the current default device, from its own copy of the config."""

    def __init__(self, model_class: type, config, name: str) -> None:
        self.model_class, self.config, self.name = model_class, config, name

    def __call__(self) -> torch.nn.Module:
        try:
            model = self.model_class(copy.deepcopy(self.config))
        except (ImportError, ValueError) as exc:  # e.g. an attention implementation the class lacks
            raise ValueError(f"{self.name}: {_one_line(exc)}") from None
        return model


def _generator() -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    return g


class _TextInputs:
    """``example_inputs`` of a text model: token ids, an attention mask of ones, and labels."""

    def __init__(self, config, labels: Optional[str], max_seq: Optional[int], default_seq: int,
                 with_mask: bool) -> None:
        self.vocab_size, self.num_labels = config.vocab_size, config.num_labels
        self.labels, self.max_seq, self.default_seq, self.with_mask = labels, max_seq, default_seq, with_mask

    def __call__(self, batch: int, *, device: str | torch.device = "cpu",
                 seq: Optional[int] = None) -> tuple[tuple, dict]:
        seq = self.default_seq if seq is None else seq
        if seq < 1 or (self.max_seq is not None and seq > self.max_seq):
            raise ValueError(f"seq must be in [1, {self.max_seq}] for this model, got {seq}")
        shape = (batch, seq)
        label_shape = (batch,) if self.labels == "class" else shape
        if torch.device(device).type == "meta":
            ids = torch.empty(shape, dtype=torch.long, device="meta")
            mask = torch.empty(shape, dtype=torch.long, device="meta")
            labels = torch.empty(label_shape, dtype=torch.long, device="meta")
        else:
            g = _generator()
            ids = torch.randint(0, self.vocab_size, shape, generator=g)
            mask = torch.ones(shape, dtype=torch.long)
            if self.labels == "input-ids":
                labels = ids.clone()
            elif self.labels == "decoder-ids":
                labels = torch.randint(0, self.vocab_size, shape, generator=g)
            else:
                labels = torch.randint(0, self.num_labels, label_shape, generator=g)
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        kwargs = {"input_ids": ids}
        if self.with_mask:
            kwargs["attention_mask"] = mask
        if self.labels is not None:
            kwargs["labels"] = labels
        return (), kwargs


class _VisionInputs:
    """``example_inputs`` of a vision model: images, and class labels for image classification."""

    def __init__(self, config, labels: Optional[str]) -> None:
        size = config.image_size
        self.height, self.width = (size, size) if isinstance(size, int) else tuple(size)
        self.channels = getattr(config, "num_channels", 3)
        self.num_labels, self.labels = config.num_labels, labels

    def __call__(self, batch: int, *, device: str | torch.device = "cpu",
                 seq: Optional[int] = None) -> tuple[tuple, dict]:
        if seq is not None:
            raise ValueError(f"image models take no sequence length (got seq={seq})")
        shape = (batch, self.channels, self.height, self.width)
        if torch.device(device).type == "meta":
            images = torch.empty(shape, dtype=torch.float32, device="meta")
            labels = torch.empty((batch,), dtype=torch.long, device="meta")
        else:
            g = _generator()
            images = torch.randn(shape, generator=g).to(device)
            labels = torch.randint(0, self.num_labels, (batch,), generator=g).to(device)
        return (), {"pixel_values": images, **({"labels": labels} if self.labels is not None else {})}
