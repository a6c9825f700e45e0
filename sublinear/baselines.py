"""Hand-written checkpointing that users write today, applied to the built-in models, for comparison.

``checkpoint_blocks``: ``torch.utils.checkpoint`` (non-reentrant) around every residual block / transformer layer,
the way HuggingFace's ``gradient_checkpointing_enable`` does it. ``checkpoint_sequential_sqrt``:
``torch.utils.checkpoint.checkpoint_sequential`` over the same sequence of blocks in sqrt(n) segments. Both edit a
model in place, so call them on a fresh copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["BASELINES", "checkpoint_blocks", "checkpoint_sequential_sqrt", "residual_blocks"]


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

    def forward(self, x, *rest):
        if any(r is not None for r in rest):
            raise ValueError("checkpoint_sequential passes one tensor between blocks; this call has more")
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


class _Skip(nn.Module):
    """Stands where a block was, once the blocks run elsewhere: returns its first input."""

    def forward(self, x, *rest):
        return x


def residual_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(container, attribute) of every residual block or transformer layer of a built-in model, in order."""
    found = []
    for name in ("layer1", "layer2", "layer3", "layer4"):  # ResNet stages
        stage = getattr(model, name, None)
        if isinstance(stage, nn.Sequential):
            found.extend((stage, str(i)) for i in range(len(stage)))
    for module in model.modules():
        for name in ("layer", "h"):  # BERT encoder layers, GPT blocks
            layers = getattr(module, name, None)
            if isinstance(layers, nn.ModuleList):
                found.extend((layers, str(i)) for i in range(len(layers)))
    if not found:
        raise ValueError(f"no residual blocks or transformer layers found in {type(model).__name__}")
    return found


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    for container, name in residual_blocks(model):
        setattr(container, name, _Checkpointed(getattr(container, name)))
    return model


def checkpoint_sequential_sqrt(model: nn.Module) -> nn.Module:
    """The blocks must form one chain passing a single tensor (true of the built-in models without masks)."""
    places = residual_blocks(model)
    blocks = [getattr(c, n) for c, n in places]
    segments = max(1, round(math.sqrt(len(blocks))))
    for container, name in places:
        setattr(container, name, _Skip())
    first_container, first_name = places[0]
    setattr(first_container, first_name, _Sequential(blocks, segments))
    return model


BASELINES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint every block": checkpoint_blocks,
    "checkpoint_sequential sqrt(n)": checkpoint_sequential_sqrt,
}
