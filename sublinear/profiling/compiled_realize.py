"""The pointwise values inductor's lowering stores in buffers although a reader could compute them: its rules for
when inlining a value into its readers would repeat too much work.

Inductor lowers a pointwise node to an expression its readers inline (no buffer) until one of these holds, read from
its config (``torch._inductor.config``), which the rules below apply to the node's expression with every inlined
pointwise value it is made from:

- the node has several readers (or one of its views has: inductor marks the value reused for them too) and its
  expression computes a costly function on the CPU (exp, log, sigmoid, tanh and the functions made of them), has
  more than ``realize_opcount_threshold`` operations (50 on the CPU, 30 else),
  or loads more than ``realize_reads_threshold`` (4) values;
- the expression loads more than ``realize_acc_reads_threshold`` values (12 on the CPU, 8 else) or has more
  operations than the opcount threshold, and more than one of its loads reads memory;
- the expression has more than 100 operations (too deep to inline);
- the node draws inductor's random numbers (``inductor_random``: its lowering stores them, float32). Forward
  computes a dropout's mask from them in the same kernel, and the buffer goes; a backward that re-runs the dropout
  reads them in the re-run's kernel and in the dropout's backward, and holds them between the two.

A long unrolled recurrence (a state-space scan's steps) or a chain of sums of gradients trips them: inductor's fused
kernel then writes several such buffers, all of them allocated before it runs. A stored value that only reductions
and values with buffers of their own read, in the kernel that makes it, is removed again (its scheduler's
kernel-local buffers): fused with its readers, it never leaves the kernel. Inlined into values that sums over
different dimensions read, the kernel runs a loop for each and loads the value from its buffer, which stays; so it
does where a value with a buffer of its own is made from such a sum through a sum over another loop (a group norm's
input gradient), which the kernel computes in a loop after them. Every load through a different view of a different
shape, strides or offset counts as a read of its own (inductor indexes the buffer anew), and a view of a computed
value re-indexes every load of its expression.

Also here: how inductor's C++ backend cuts a backward into kernels (every fused node between two library calls is one
function) and from where a value such a kernel re-runs takes memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from sublinear.capture.joint import data_inputs, is_view
from sublinear.profiling.compiled_dataflow import StepStorages, StorageReads
from sublinear.profiling.compiled_nodes import InductorKinds

__all__ = ["kernel_segments", "kernel_starts", "realized_by_lowering", "same_elements", "stored_by_lowering"]

# aten ops whose lowering computes exp, log, log10, log1p, log2, sigmoid or tanh (inductor's costly functions on
# the CPU) once decomposed
_COSTLY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh", "softplus", "softplus_backward",
                     "silu", "silu_backward", "mish", "mish_backward", "logit", "logit_backward",
                     "log_sigmoid_forward", "log_sigmoid_backward", "elu", "elu_backward"})


_INLINE_LIMIT = 100  # operations beyond which inductor's lowering stores any pointwise value
_AS_STRIDED = frozenset({torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default})
_SCATTERS = frozenset({torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default})


@dataclass(frozen=True)
class _Expression:
    """A pointwise value as its readers would inline it: the loads (per buffer and view), the operations and
    whether one is costly on the CPU."""

    loads: frozenset
    operations: frozenset
    costly: bool


def stored_by_lowering(nodes: Sequence[fx.Node], kinds: InductorKinds, readers: Callable[[fx.Node], int],
                       buffered: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The fusible nodes of ``nodes`` (one graph, in order) that inductor stores in a buffer by the rules above and
    keeps (see above); ``readers(node)``: how many nodes of that graph read ``node`` (its output counting as one);
    ``buffered(node)``: whether a fusible node's value is a buffer anyway (a library kernel reads it, the graph
    returns or saves it)."""
    kernel = {nodes[k]: i for i, segment in enumerate(kernel_segments(nodes, kinds)) for k in segment}

    found_readers: dict[tuple[fx.Node, bool], frozenset | None] = {}

    def readers_in_kernel(node: fx.Node, inlined: bool) -> frozenset | None:
        """The readers in its kernel that load ``node`` through values inlined into them (``inlined``: ``node``
        itself is one), each as (reader, inlined), or None when a reader is in another kernel: reductions, and
        values with buffers of their own, which read it where they store theirs. Readers without a buffer that read
        all of it, element for element, inline it into their own readers; a reader of a part of it (a strided
        slice) loops over other indices."""
        if (node, inlined) not in found_readers:
            found: set | None = set()
            for user in node.users:
                if kernel.get(user, -1) != kernel[node] or kinds.extern(user):
                    found = None
                    break
                if not kinds.fusible(user) or buffered(user):
                    found.add((user, inlined))
                    continue
                inner = readers_in_kernel(user, True) if same_elements(user, node) else None
                if inner is None:
                    found = None
                    break
                found |= inner
            found_readers[node, inlined] = None if found is None else frozenset(found)
        return found_readers[node, inlined]

    def kernel_local(node: fx.Node) -> bool:
        """Read only in its kernel, where inlined in one loop of it, and by no stored value that waits for a sum of
        another loop made from it: fused with its readers."""
        read = readers_in_kernel(node, False)
        if read is None:
            return False
        sums = {user for user, _ in read if not kinds.fusible(user)}
        loops = {_loop(user) for user, inlined in read if inlined and user in sums}
        return len(loops) <= 1 and not any(_waits_for_another_loop(user, sums, kernel, kinds) for user, _ in read
                                           if user not in sums)

    return {node for node in _realized(nodes, kinds, readers) if not kernel_local(node)}


def realized_by_lowering(nodes: Sequence[fx.Node], kinds: InductorKinds, readers: Callable[[fx.Node], int]
                         ) -> set[fx.Node]:
    """The fusible nodes of ``nodes`` that inductor's lowering stores by the rules above, the scheduler's
    kernel-local ones among them: each is a node of its own in its kernel."""
    return _realized(nodes, kinds, readers)


def kernel_segments(nodes: Sequence[fx.Node], kinds: InductorKinds) -> list[list[int]]:
    """Positions of ``nodes`` cut into what inductor runs as one kernel: each library kernel alone, and every run of
    other nodes between two of them together."""
    segments: list[list[int]] = []
    for k, node in enumerate(nodes):
        alone = kinds.extern(node)
        if alone or not segments or kinds.extern(nodes[segments[-1][-1]]):
            segments.append([])
        segments[-1].append(k)
    return segments


def kernel_starts(bw: list[fx.Node], reads: StorageReads, storages: StepStorages, kinds: InductorKinds
                  ) -> dict[int, tuple[int, bool]]:
    """Per forward value that a fused backward kernel reads at a rank below its first (highest), or that the library
    call after the kernel reads: that kernel's start, the earliest where several read it. The kernel allocates all
    its buffers before it runs, so a value it re-runs inside it takes memory from there on; inductor's C++ backend
    runs every fused node between two library calls as one function, so a value a call reads is re-run in the kernel
    before it. A start is (rank, early): the kernel's first rank, and whether it starts before that rank's backward
    let go of what it read last (not, for the kernel after a convolution's backward call, which reads its input
    last)."""
    ranks, release = reads.rank_of_backward, reads.release_nodes()
    starts: dict[int, tuple[int, bool]] = {}
    previous = (-1, True)  # the fused kernel just before
    for segment in kernel_segments(bw, kinds):
        top = max(ranks[k] for k in segment)
        library = kinds.extern(bw[segment[0]])
        start = previous if library else (top, release.get(top, len(bw)) >= segment[0])
        for k in segment:
            if ranks[k] >= start[0]:
                continue
            for key in (key for arg in data_inputs(bw[k]) for key in storages.keys_of(arg)):
                if key in storages.produced_by:
                    starts[key] = max(starts.get(key, start), start)
        previous = (-1, True) if library else start
    return starts


def _waits_for_another_loop(stored: fx.Node, sums: set[fx.Node], kernel: dict[fx.Node, int], kinds: InductorKinds
                            ) -> bool:
    """Whether the stored value ``stored`` is made, in its kernel, from one of ``sums`` through a sum over another
    loop (a group norm's input gradient, from per-channel sums summed again per group): it runs in a loop after
    those sums, so what they and it both read is kept in a buffer between the loops. A value made from the sums
    alone (a layer norm's input gradient) is not counted: inductor keeps the stored value then too, but writes
    that value into it, as much memory as the profile's buffer of that value alone."""
    loops = {_loop(s) for s in sums}
    seen, stack, from_sums, other_loop = {stored}, [stored], False, False
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg in seen or kernel.get(arg, -1) != kernel[stored]:
                continue
            seen.add(arg)
            from_sums = from_sums or arg in sums
            other_loop = other_loop or (not kinds.fusible(arg) and _loop(arg) not in loops)
            stack.append(arg)
    return from_sums and other_loop


def _realized(nodes: Sequence[fx.Node], kinds: InductorKinds, readers: Callable[[fx.Node], int]) -> set[fx.Node]:
    from torch._inductor import config  # noqa: PLC0415

    realized: set[fx.Node] = set()
    expressions: dict[fx.Node, _Expression] = {}
    for node in nodes:
        if not kinds.fusible(node):
            continue
        if node.target in _AS_STRIDED:
            _store_viewed(node.args[0], expressions, realized)
        view = is_view(node)
        loads: set = set()
        operations: set = set() if view else {node}
        costly = not view and _costly(node)
        for arg in node.all_input_nodes:
            inlined = expressions.get(arg)
            if inlined is None:  # a buffer: a library call's or a reduction's result, a graph input, a realized value
                loads.add((arg, _layout(node) if view else _scattered(node, arg)))
                continue
            loads |= {(buffer, _through(node, arg, through)) for buffer, through in inlined.loads}
            operations |= inlined.operations
            costly = costly or inlined.costly
        if view:
            expressions[node] = _Expression(frozenset(loads), frozenset(operations), costly)
            continue
        cpu = _on_cpu(node)
        opcount_limit = _threshold(config, "realize_opcount_threshold", cpu)
        reads_limit = _threshold(config, "realize_acc_reads_threshold", cpu)
        count = len(operations) + len(loads)
        many = count > opcount_limit
        reused = ((cpu and costly) or many or len(loads) > config.realize_reads_threshold) and _reused(node, readers)
        if kinds.stored(node) or reused or (len(loads) > 1 and (len(loads) > reads_limit or many)) or \
                count > _INLINE_LIMIT:
            realized.add(node)
        else:
            expressions[node] = _Expression(frozenset(loads), frozenset(operations), costly)
    return realized


def _store_viewed(value: fx.Node, expressions: dict[fx.Node, _Expression], realized: set[fx.Node]) -> None:
    """``as_strided`` reads a buffer: inductor stores the value it views (through other views), and the views in
    between then load that buffer."""
    chain = []
    while is_view(value) and value in expressions:
        chain.append(value)
        value = value.args[0]
    if value not in expressions:
        return
    realized.add(value)
    del expressions[value]
    for view in chain:  # each a view of the buffer: it loads the buffer as its own layout says
        expressions[view] = _Expression(frozenset({(value, _layout(view))}), frozenset(), False)


def _loop(reduction: fx.Node) -> tuple:
    """The loop a reduction (or another kernel that is not fused pointwise) reads its input in: its input's shape
    (sizes may be symbols) and the dimensions it reduces over."""
    source = reduction.args[0] if reduction.args and isinstance(reduction.args[0], fx.Node) else None
    value = source.meta.get("val") if source is not None else None
    rank = value.dim() if isinstance(value, torch.Tensor) else 0
    dims = reduction.args[1] if len(reduction.args) > 1 else reduction.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return (str(reduction.target), reduction.name)
    return (str(tuple(value.shape)) if rank else "", tuple(sorted(d % rank for d in dims)) if rank else ())


def same_elements(reader: fx.Node, node: fx.Node) -> bool:
    """Whether ``reader`` reads every element of ``node`` once, in its order: as many elements, and a view that
    keeps them in place (both contiguous)."""
    value, read = node.meta.get("val"), reader.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(read, torch.Tensor) \
            or str(value.numel()) != str(read.numel()):  # sizes may be symbols
        return False
    return not is_view(reader) or (value.is_contiguous() and read.is_contiguous())


def _reused(node: fx.Node, readers: Callable[[fx.Node], int]) -> bool:
    """Whether several nodes read ``node``, or read a view of it: inductor marks a value reused for the readers of
    each of its views too (a softplus's output read only through an unsqueeze, which every step of a scan reads)."""
    return readers(node) > 1 or any(is_view(user) and _reused(user, readers) for user in node.users)


@dataclass(frozen=True)
class _Reindexed:
    """A load of a computed value's expression seen through a view of that value (``layout``): the view re-indexes
    the load, which reached the buffer ``inner`` (a layout, another re-indexing, or None: as it is)."""

    inner: Any
    layout: tuple


def _through(node: fx.Node, arg: fx.Node, through: Any) -> Any:
    """How ``node`` indexes a buffer that ``arg``'s expression loads ``through`` a view (None: as it is). A view of a
    view of that buffer indexes it as its own layout says; a view of a computed value re-indexes each of its loads
    (two slices of a product of two slices load four different parts of the buffer), and a view of that view
    replaces the outer layout only. A scatter loads its source at the positions it writes it to (a scan's
    gradient, scattered back to the odd and the even steps, loads the gradient of each half twice)."""
    scattered = _scattered(node, arg)
    if scattered is not None:
        return _Reindexed(through, scattered)
    if not is_view(node):
        return through
    if not is_view(arg):
        return _Reindexed(through, _layout(node))
    if isinstance(through, _Reindexed):
        return _Reindexed(through.inner, _layout(node))
    return _layout(node)


def _scattered(node: fx.Node, arg: fx.Node) -> tuple | None:
    """How a scatter indexes its source ``arg`` (None: ``node`` is no scatter of it)."""
    if node.target in _SCATTERS and len(node.args) > 1 and node.args[1] is arg:
        return (str(node.target), *map(str, node.args[2:]))
    return None


def _layout(view: fx.Node) -> tuple:
    """How a view indexes its buffer (equal views load the same elements: one read, as inductor counts them)."""
    value = view.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return (view,)
    return str(tuple(value.shape)), str(value.stride()), str(value.storage_offset())  # sizes may be symbols


def _costly(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._opname
    if name == "gelu" or name == "gelu_backward":
        return node.kwargs.get("approximate", "none") == "tanh"
    return name in _COSTLY


def _on_cpu(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _threshold(config: Any, name: str, cpu: bool) -> int:
    """Inductor's setting ``name`` in ``config``; where it is None (torch 2.13 and later), its CPU value or its
    default. Older torch (2.11) has one value for every device and neither of the other two settings."""
    setting = getattr(config, name)
    if setting is not None:
        return setting
    return getattr(config, name.replace("realize_", "realize_cpu_", 1)) if cpu else getattr(config, f"_{name}_default")
