"""Hand-written checkpointing that users write today, for comparison.

``checkpoint_blocks``: ``torch.utils.checkpoint`` (non-reentrant) around every residual block / transformer layer.
``checkpoint_sequential_sqrt``: ``torch.utils.checkpoint.checkpoint_sequential`` over the same sequence of blocks
in sqrt(n) segments. ``hf_gradient_checkpointing``: a transformers model's own gradient checkpointing (every layer,
non-reentrant). Each edits a model in place, so call it on a fresh copy, once. A strategy that does not apply to a
model raises :class:`NotApplicable`, when it is applied or at the first step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["BASELINES", "NotApplicable", "checkpoint_blocks", "checkpoint_sequential_sqrt",
           "hf_gradient_checkpointing", "residual_blocks"]

LAYER_LISTS = ("layer", "layers", "h", "block", "blocks")  # names of the ModuleList holding a model's layers


class NotApplicable(ValueError):
    """The strategy cannot be applied to this model."""


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class _Sequential(nn.Module):
    """Runs every block with checkpoint_sequential, in the place of the first block."""

    def __init__(self, blocks: list[nn.Module], segments: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.segments = segments

    def forward(self, x, *rest, **kwargs):
        if any(r is not None for r in (*rest, *kwargs.values())):
            raise NotApplicable("checkpoint_sequential passes one tensor between blocks, and these blocks take "
                                "more arguments")
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


class _Skip(nn.Module):
    """Stands where a block was, once the blocks run elsewhere: returns its first input."""

    def forward(self, x, *rest, **kwargs):
        return x


def _layer_lists(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Entries of the ModuleLists named in LAYER_LISTS whose entries are all called (they define ``forward``), in
    order, without looking inside the entries."""
    for name, child in module.named_children():
        if name in LAYER_LISTS and isinstance(child, nn.ModuleList) and len(child) and all(
                type(entry).forward is not nn.Module.forward for entry in child):
            yield from ((child, str(i)) for i in range(len(child)))
        else:
            yield from _layer_lists(child)


def residual_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(container, attribute) of every residual block (ResNet stages ``layer1``..``layer4``) or transformer layer
    (a ModuleList named as in LAYER_LISTS, outermost only), in order; :class:`NotApplicable` if none."""
    found = []
    for name in ("layer1", "layer2", "layer3", "layer4"):
        stage = getattr(model, name, None)
        if isinstance(stage, nn.Sequential):
            found.extend((stage, str(i)) for i in range(len(stage)))
    found.extend(_layer_lists(model))
    if not found:
        raise NotApplicable(f"no residual blocks or transformer layers found in {type(model).__name__}")
    return found


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    for container, name in residual_blocks(model):
        setattr(container, name, _Checkpointed(getattr(container, name)))
    return model


def checkpoint_sequential_sqrt(model: nn.Module) -> nn.Module:
    """The blocks must form one chain passing a single tensor (true of the built-in models without masks);
    otherwise the first step raises :class:`NotApplicable`."""
    places = residual_blocks(model)
    blocks = [getattr(c, n) for c, n in places]
    segments = max(1, round(math.sqrt(len(blocks))))
    for container, name in places:
        setattr(container, name, _Skip())
    first_container, first_name = places[0]
    setattr(first_container, first_name, _Sequential(blocks, segments))
    return model


def hf_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``, through
    ``activation_checkpointing_enable`` where transformers has it (the name it deprecates the former for). Under
    it transformers also turns ``use_cache`` off in training."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise NotApplicable(f"{type(model).__name__} is not a transformers model that supports gradient "
                            "checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


BASELINES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint every block": checkpoint_blocks,
    "checkpoint_sequential sqrt(n)": checkpoint_sequential_sqrt,
    "HF gradient_checkpointing_enable": hf_gradient_checkpointing,
}
