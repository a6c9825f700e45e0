"""Where the partitioned backward stores the values that library calls read: marks for inductor's lowering
(``inductor_realize_to_strides``) that make the compiled backward hold them as the plan's memory model does."""

from __future__ import annotations

import bisect

import torch
from torch import fx

from sublinear.capture.joint import is_view
from sublinear.profiling.compiled_nodes import CONVOLUTION_OPS, InductorKinds

__all__ = ["realized_in_place"]


def realized_in_place(backward: fx.GraphModule, channels_last: bool) -> None:
    """Inductor computes a pointwise value that only library calls read (through views) when it lowers the first
    of them, unless something stores it before: where another library call runs between the value and that reader
    (a convolution re-run for it, in a backward that recomputes), the value and what it is made from wait across
    that call. Such a value is stored where the graph computes it (``inductor_realize_to_strides``), as the plan's
    memory model has it: a group norm's input gradient, summed with the residual's gradient for the convolution's
    backward below, was computed after the re-run of that convolution's input, and held the norm's input and the
    gradients it is made from through the re-run. It is stored in the layout its reader takes
    (:func:`_stored_as_convolution_reads`). So is a value a channels-last convolution reads as a reshape of it (a
    group norm's input gradient, computed per group), whatever else reads it: stored when the convolution's
    lowering asks for it, it would be laid out contiguous and copied into channels-last; stored where it is
    computed, it follows its channels-last inputs, and the reshape is channels-last as it is."""
    kinds = InductorKinds()
    nodes = [n for n in backward.graph.nodes if n.op == "call_function"]
    libraries = [k for k, node in enumerate(nodes) if kinds.extern(node)]
    position = {node: k for k, node in enumerate(nodes)}
    copied = False
    for k, node in enumerate(nodes):
        if not kinds.fusible(node) or is_view(node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers = _readers_through_views(node)
        if channels_last and _reshaped_for_convolution(node):
            node.meta["inductor_realize_to_strides"] = True
        if not readers or not all(kinds.extern(r) for r in readers):
            continue
        first = min(position.get(r, k) for r in readers)
        if bisect.bisect_left(libraries, first) > bisect.bisect_right(libraries, k):
            copied = _stored_as_convolution_reads(backward.graph, node) or copied
    if copied:
        backward.recompile()


def _stored_as_convolution_reads(graph: fx.Graph, node: fx.Node) -> bool:
    """Mark ``node`` stored where the graph computes it; where only convolutions' backwards read it, as their
    output gradient, beside a channels-last input, mark a channels-last copy of it instead, which they then read.
    Inductor stores a marked value at its traced strides (contiguous, where it sums gradients that library calls
    returned so) and copies it into the layout the convolution's backward takes (its input's) where it lowers
    that call; the copy is fused into the kernel that makes the value, and inductor's C++ backend allocates every
    buffer of the fused nodes between two library calls before they run, so the value is held twice through the
    re-run between: in a VAE's decoder that recomputes, a group norm's input gradient held 2.25 MiB twice. Stored
    channels-last where it is computed, it is made once, as the plan's memory model counts it. Returns whether a
    copy was added."""
    value = node.meta["val"]
    readers = list(node.users)
    if _channels_last(value) or not all(isinstance(n, int) for n in value.shape) or not all(
            r.target is torch.ops.aten.convolution_backward.default and r.args[0] is node and node not in r.args[1:]
            and _channels_last(r.args[1].meta.get("val")) for r in readers):
        node.meta["inductor_realize_to_strides"] = True
        return False
    with graph.inserting_after(node):
        copy = graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.channels_last})
    copy.meta = {**node.meta, "val": value.clone(memory_format=torch.channels_last),
                 "inductor_realize_to_strides": True}
    for reader in readers:
        reader.replace_input_with(node, copy)
    return True


def _channels_last(value: object) -> bool:
    """Whether ``value`` is a 4-D tensor laid out channels-last (and not also contiguous). Sizes that are symbols
    answer no: asking would add guards to the compiled code's family."""
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or \
            not all(isinstance(n, int) for n in (*value.shape, *value.stride())):
        return False
    return not value.is_contiguous() and value.is_contiguous(memory_format=torch.channels_last)


def _reshaped_for_convolution(node: fx.Node) -> bool:
    """Whether a convolution reads ``node`` through a view of another shape."""
    shape = str(tuple(node.meta["val"].shape))  # sizes may be symbols
    return any(is_view(user) and isinstance(view := user.meta.get("val"), torch.Tensor)
               and str(tuple(view.shape)) != shape
               and any(r.target in CONVOLUTION_OPS for r in _readers_through_views(user)) for user in node.users)


def _readers_through_views(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s value, through views of it."""
    readers = []
    for user in node.users:
        readers += _readers_through_views(user) if is_view(user) else [user]
    return readers
