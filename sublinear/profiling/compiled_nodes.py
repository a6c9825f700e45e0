"""What inductor makes of one node of the joint graph: a fused kernel or a library call (:class:`InductorKinds`),
whether it draws random numbers, writes an input or communicates, its FLOPs and estimated seconds, whether
convolutions run channels-last, and a library call's scratch space measured on the device (:mod:`.kernels`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._prims_common import _is_non_overlapping_and_dense_or_false, make_channels_last_strides_for
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from sublinear.capture.joint import data_inputs, is_view
from sublinear.profiling.costs import DeviceRates, computes_in_half, estimate_seconds
from sublinear.profiling.kernels import KernelMemory, KernelRun, TensorLayout
from sublinear.profiling.tracking import COUNTED_INSIDE, inside_peak
from sublinear.tensors import size_hint as hint

# Ops that inductor lowers to loads and stores it can fuse, although torch does not tag them pointwise.
_FUSIBLE = ("aten.embedding.default", "aten.index.Tensor", "aten.full.default", "aten.scalar_tensor.default",
            "prims.iota.default", "aten.constant_pad_nd.default", "aten.slice_scatter.default",
            "aten.select_scatter.default", "prims.inductor_random.default", "prims.inductor_lookup_seed.default",
            "aten.zeros.default", "aten.ones.default", "prims._low_memory_max_pool_offsets_to_indices.default")
# Pointwise ops whose lowering always stores the value in a buffer (inductor's random numbers, float32 whatever the
# dtype of their reader); the scheduler drops the buffer again where only its own kernel reads it.
_STORED = ("prims.inductor_random.default",)
# Matrix products inductor calls as library kernels although they are not in its needs-realized set, and the seeds
# of its random numbers (one ``aten.randint`` call, between the fused kernels around it).
_EXTERN = ("aten.addmm.default", "aten.baddbmm.default", "aten.addbmm.default", "aten._addmm_activation.default",
           "prims.inductor_seeds.default")
# Random ops inductor runs as aten's own kernels under its ``fallback_random`` (else it draws their numbers itself).
_RANDOM_FALLBACKS = ("aten.native_dropout.default", "aten.rand.default", "aten.randn.default", "aten.bernoulli.p",
                     "aten.bernoulli_.float")
# The convolutions, forward and backward: inductor may run them on channels-last copies of their tensors.
CONVOLUTION_OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def _ops(names: Sequence[str]) -> frozenset:
    """The op overloads of ``names`` that this torch has (inductor's prims once inductor registered them)."""
    import torch._inductor.inductor_prims  # noqa: F401, PLC0415 - registers prims.inductor_*

    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


class InductorKinds:
    """What inductor does with each node: fuse it (pointwise), call a library kernel that needs its inputs in memory
    (extern), or make a buffer of its result with its inputs fused in (reductions and the rest)."""

    def __init__(self) -> None:
        from torch._inductor import config, lowering  # noqa: PLC0415

        self.realized_inputs, self.fallbacks = frozenset(lowering.needs_realized_inputs), frozenset(lowering.fallbacks)
        self.fusible_ops, self.stored_ops = _ops(_FUSIBLE), _ops(_STORED)
        self.extern_ops = _ops(_EXTERN) | (_ops(_RANDOM_FALLBACKS) if config.fallback_random else frozenset())

    def fusible(self, node: fx.Node) -> bool:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return False
        return torch.Tag.pointwise in target.tags or target in self.fusible_ops or target.is_view

    def stored(self, node: fx.Node) -> bool:
        """Whether inductor's lowering stores ``node``'s value in a buffer whatever reads it."""
        return node.target in self.stored_ops

    def extern(self, node: fx.Node) -> bool:
        """Whether inductor calls a kernel of its own for ``node``: a library call, or a custom op (an operator
        outside aten and prims, which inductor runs as the op itself)."""
        target = node.target
        return isinstance(target, torch._ops.OpOverload) and not _bmm_lowered_as_sum(node) and (
            target in self.realized_inputs or target in self.fallbacks or target in self.extern_ops
            or target.namespace not in ("aten", "prims", "inductor_prims", "prim"))


_BMM_DOT_INNER_LIMIT = 32  # inductor's tuned_bmm: the largest inner dimension it sums on CUDA and XPU


def _bmm_lowered_as_sum(node: fx.Node) -> bool:
    """Whether inductor lowers the batched matrix product ``node`` to a multiply and a sum over the inner dimension
    (a reduction its fused kernels compute, no library call): on the CPU when either output dimension is 1, on CUDA
    and XPU when both are and the inner dimension is at most 32 (its ``tuned_bmm``)."""
    if node.target is not torch.ops.aten.bmm.default or len(node.args) < 2:
        return False
    a, b = (arg.meta.get("val") if isinstance(arg, fx.Node) else None for arg in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 3 or b.dim() != 3:
        return False
    rows, columns, inner = hint(a.shape[1]), hint(b.shape[2]), hint(a.shape[2])
    if a.device.type == "cpu" and b.device.type == "cpu":
        return rows == 1 or columns == 1
    return a.device.type in ("cuda", "xpu") and b.device == a.device and a.dtype == b.dtype and \
        a.dtype.is_floating_point and a.dtype.itemsize >= 2 and rows == 1 and columns == 1 and \
        inner <= _BMM_DOT_INNER_LIMIT


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors among ``value``'s pytree leaves, in order."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def storage_key_of(t: torch.Tensor) -> int:
    """The key of ``t``'s storage, shared by all its views (``t`` must have a storage, as joint-graph values do)."""
    return t.untyped_storage()._cdata


def draws_random(node: fx.Node) -> bool:
    """Whether ``node``'s op draws random numbers (tagged nondeterministic-seeded)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def is_constant(node: fx.Node, kinds: InductorKinds) -> bool:
    """Whether ``node`` is a constant (a fusible node of no inputs that draws no random numbers: ``full``,
    ``zeros``, ``iota``): inductor makes its values inside every kernel that reads it, so it takes no memory unless
    forward saves it for backward."""
    return node.op == "call_function" and not node.all_input_nodes and kinds.fusible(node) and not draws_random(node)


def writes_input(node: fx.Node) -> bool:
    """Whether ``node``'s op writes into an argument, as its schema declares (BatchNorm's running statistics)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def communicates(node: fx.Node) -> bool:
    """Whether ``node`` is a functional collective (c10d)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("_c10d_functional", "c10d_functional")


def flops_of(node: fx.Node) -> int:
    """``node``'s FLOPs by torch's flop counter formulas; 0 where there is none or it cannot read the values."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    count = flop_registry.get(target.overloadpacket)
    if count is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    try:
        return hint(count(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read symbolic or missing values counts nothing
        return 0


def channels_last_convolutions(gm: fx.GraphModule) -> bool:
    """Whether inductor will lay this graph's convolutions out channels-last (its own heuristic)."""
    from torch._inductor.graph import GraphLowering  # noqa: PLC0415

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # noqa: BLE001 - a heuristic that cannot read this graph: inductor's default layout
        return False


def estimate_node_seconds(node: fx.Node, node_flops: int, keys_of, materialized, size_of: dict[int, int],
                          state: dict[int, tuple[str, int]], kinds: InductorKinds, rates: DeviceRates) -> float:
    """One node's estimated time: its FLOPs, the buffers it reads (materialised values, state) and writes."""
    if is_view(node):
        return 0.0
    read = 0
    for arg in data_inputs(node):
        for key in keys_of(arg):
            if key in state:
                read += state[key][1]
            elif materialized(key):
                read += size_of[key]
    written = [key for key in keys_of(node) if materialized(key)]
    wrote = sum(size_of[key] for key in written)
    kernels = 1 if (written or kinds.extern(node)) else 0
    half = node_flops if computes_in_half(node.meta.get("val")) else 0
    return estimate_seconds(node_flops, read + wrote, kernels, rates, half)


@dataclasses.dataclass
class LibraryCalls:
    """What library calls take beside their arguments and results. ``scratch``: per call, the bytes its kernel
    allocates inside the call beyond its results, and the copies of its arguments into the layouts it takes that
    stay beside the arguments. ``copied``: per call, the bytes of all those copies, which the fused kernel before
    the call makes beside what it reads. ``layouts``: per argument that a fused kernel makes for a convolution
    lowered as traced, the stride the convolution has it made in. ``result_layouts``: per storage a call makes in
    another layout than traced (a channels-last step's convolutions return channels-last results), that stride."""

    scratch: dict[fx.Node, int]
    copied: dict[fx.Node, int]
    layouts: dict[fx.Node, tuple[int, ...]]
    result_layouts: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def fits(self, made: fx.Node, into_key: int, into: Any) -> bool:
        """Whether a kernel can write ``made`` into the buffer of storage ``into_key`` (of its size, traced as
        ``into``): inductor writes a result in place only where it is indexed as the input it replaces, so a value a
        call has made in its own layout only into one of that layout, as the call that made ``into_key`` lays it
        out."""
        stride = self.layouts.get(made)
        if stride is None:
            return True
        if into_key in self.result_layouts:
            return self.result_layouts[into_key] == stride
        return isinstance(into, torch.Tensor) and tuple(hint(s) for s in into.stride()) == stride

    def copies_made(self, segments: Sequence[Sequence[int]], nodes: Sequence[fx.Node], kinds: InductorKinds
                    ) -> list[int]:
        """Per kernel segment of ``nodes``: the bytes of layout copies it makes, which a fused kernel makes for the
        library call after it."""
        return [0 if kinds.extern(nodes[segment[0]]) or at + 1 == len(segments)
                else self.copied.get(nodes[segments[at + 1][0]], 0) for at, segment in enumerate(segments)]


def library_scratch(nodes: Sequence[fx.Node], kinds: InductorKinds, channels_last: bool,
                    kernels: KernelMemory | None, forward: set[fx.Node],
                    released: Callable[[fx.Node, fx.Node], bool]) -> LibraryCalls:
    """The library nodes' :class:`LibraryCalls`, measured on the device, with convolutions' tensors in the layouts
    inductor gives them. An argument ``released(node, arg)`` is freed by the kernel copying it (the copy takes its
    place), so its copy adds no scratch. Where nothing is measured (``kernels`` None: planning on meta), the copies
    are counted all the same (they follow from the layouts alone), and so is an operator whose allocations are its
    Python code's (sublinear's chunked LM head), by running its code on meta; the library kernels may hold more
    scratch on a device."""
    runs = {node: run for node in nodes
            if kinds.extern(node) and (run := _library_run(node, channels_last, _laid_out(node, kinds, forward)))}
    if channels_last:
        for node, copies in _shared_gradient_copies(nodes, kinds, forward).items():
            if node in runs:
                runs[node].copies.extend(copies)
    calls = LibraryCalls({}, {}, {})
    if kernels is None:
        calls.scratch.update({node: _counted_inside(node) for node in nodes if node.target in COUNTED_INSIDE})
    else:
        kernels.measure([run.kernel for run in runs.values()])
    for node, run in runs.items():
        measured = kernels.get(run.kernel.key) if kernels is not None else None
        kept = sum(nbytes for arg, nbytes in run.copies if not released(node, arg))
        if measured is not None:
            results = sum(hint(t.untyped_storage().nbytes()) for t in tensor_leaves(node.meta.get("val")))
            calls.scratch[node] = max(0, measured.inside_peak - results) + kept
        elif kept:
            calls.scratch[node] = calls.scratch.get(node, 0) + kept
        if run.copies:
            calls.copied[node] = sum(nbytes for _arg, nbytes in run.copies)
        calls.layouts.update(run.layouts)
        if channels_last and node.target in CONVOLUTION_OPS:
            calls.result_layouts.update(_channels_last_results(node))
    return calls


def _channels_last_results(node: fx.Node) -> dict[int, tuple[int, ...]]:
    """Per 4-d dense result of a convolution (or its backward) in a channels-last step: its channels-last stride,
    as the call returns it for channels-last arguments."""
    return {storage_key_of(t): tuple(make_channels_last_strides_for(shape)) for t in tensor_leaves(node.meta.get("val"))
            if len(shape := tuple(hint(s) for s in t.shape)) == 4 and _dense(t)}


def _shared_gradient_copies(nodes: Sequence[fx.Node], kinds: InductorKinds, forward: set[fx.Node]
                            ) -> dict[fx.Node, list[tuple[fx.Node, int]]]:
    """Per convolution's backward in a channels-last step, the copy of its output gradient the fused kernel before
    it writes. Inductor fixes a value that several nodes read, one of them a convolution's backward, in its traced
    layout, and the call takes the gradient channels-last. A backward that re-runs convolutions lays out
    channels-last what flows from the values that feed them (its ``find_nodes_prefer_channels_last``), so only a
    gradient none of those flow into (made from the outputs' gradients alone, as a pooling's) is copied whatever
    the plan; the others are not counted."""
    feeding: set[fx.Node] = set()
    stack = [node for node in nodes if node.target is torch.ops.aten.convolution.default]
    while stack:
        node = stack.pop()
        if node not in feeding:
            feeding.add(node)
            stack.extend(node.all_input_nodes)
    fed: dict[fx.Node, bool] = {}
    for node in nodes:
        fed[node] = node in feeding or any(fed.get(arg, arg in feeding) for arg in node.all_input_nodes)
    copies = {}
    for node in nodes:
        grad = node.args[0] if node.target is torch.ops.aten.convolution_backward.default else None
        value = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 4 or len(grad.users) < 2 or fed.get(grad, True) \
                or _laid_out(node, kinds, forward)(grad) or value.is_contiguous(memory_format=torch.channels_last):
            continue
        copies[node] = [(grad, hint(value.untyped_storage().nbytes()))]
    return copies


def _laid_out(node: fx.Node, kinds: InductorKinds, forward: set[fx.Node]):
    """Whether an argument of ``node`` has its layout fixed before the call (a graph input, a library kernel's
    result, a forward value backward reads, or a view of one, or a view that is not dense: a part of a larger
    buffer), so that another layout is a copy; a fused kernel's result takes the layout its reader asks for."""
    backward = node not in forward

    def fixed(arg: fx.Node) -> bool:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor) and not _dense(value):
            return True
        while arg.args and isinstance(arg.args[0], fx.Node) and (is_view(arg) or arg.target is operator.getitem):
            arg = arg.args[0]
        return arg.op == "placeholder" or kinds.extern(arg) or (backward and arg in forward)
    return fixed


def _dense(value: torch.Tensor) -> bool:
    """Whether ``value``'s elements fill its storage span in some order of its dimensions, judged at the sizes'
    hints (no guard is added to a dynamic family's shapes)."""
    return _is_non_overlapping_and_dense_or_false(tuple(hint(s) for s in value.shape),
                                                  tuple(hint(s) for s in value.stride()))


def _counted_inside(node: fx.Node) -> int:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
    return inside_peak(node.target, args, kwargs)


_TENSOR = "<tensor>"


def _lowered_convolution_layouts(target, args: tuple, inputs: dict[str, TensorLayout], fixed: set[str]
                                 ) -> dict[str, int]:
    """The layouts inductor's lowering gives a convolution's tensors outside channels-last graphs: forward, the
    input and the weight in the stride order of the output as aten lays it out; backward, for the weight's gradient
    the output's gradient and the input in that gradient's order, then for the input's gradient the output's
    gradient and the weight in its order. (A depthwise weight's gradient has two strides of 1, so its order puts the
    input's channels between its rows and columns, and aten takes no channels-last scratch.) Returns the bytes of
    the copies per tensor: a tensor in ``fixed`` (its layout fixed before) is copied into each other layout asked
    for; a fused kernel's result is made in the first layout asked for, and copied into another asked for after
    (a depthwise convolution's output gradient)."""
    from torch._inductor.ir import FlexibleLayout, get_stride_order  # noqa: PLC0415

    def meta(name: str) -> torch.Tensor:
        return inputs[name].make(torch.device("meta"))

    copied: dict[str, int] = defaultdict(int)

    def require(names: Sequence[str], made: torch.Tensor) -> None:
        order = get_stride_order(made.stride())
        for name in names:
            layout = inputs[name]
            if not _in_order(layout.shape, layout.stride, order):
                inputs[name] = dataclasses.replace(layout, stride=tuple(FlexibleLayout.stride_ordered(layout.shape,
                                                                                                      order)))
                if name in fixed:
                    copied[name] += math.prod(layout.shape) * getattr(torch, layout.dtype).itemsize
            fixed.add(name)  # made in the first layout asked for, then copied into another

    if target is torch.ops.aten.convolution.default:
        source, weight = args[0][1], args[1][1]
        require((source, weight), torch.ops.aten.convolution.default(meta(source), meta(weight), None, *args[3:]))
        return copied
    grad, source, weight = (arg[1] for arg in args[:3])
    for which, required in ((1, (grad, source)), (0, (grad, weight))):
        if args[10][which]:
            flags = [i == which for i in range(3)]
            made = torch.ops.aten.convolution_backward.default(meta(grad), meta(source), meta(weight), None,
                                                               *args[4:10], flags)[which]
            require(required, made)
    return copied


def _in_order(shape: Sequence[int], stride: Sequence[int], order: Sequence[int]) -> bool:
    """Whether ``stride`` runs in stride ``order`` (0: fastest) over the dimensions of more than one element, as
    inductor checks a layout before copying it into another."""
    kept = [i for i, n in enumerate(shape) if n != 1]
    sub = [order[i] for i in kept]
    ranked = sorted(sub)
    by_order = [0] * len(kept)
    for i, o in zip(kept, sub):
        by_order[ranked.index(o)] = stride[i]
    return all(a <= b for a, b in zip(by_order, by_order[1:]))


@dataclasses.dataclass
class _LibraryRun:
    kernel: KernelRun
    copies: list[tuple[fx.Node, int]]  # the arguments copied into the layouts the call takes, and the bytes of each
    layouts: dict[fx.Node, tuple[int, ...]]  # the arguments a fused kernel makes in the layout the call takes


def _library_run(node: fx.Node, channels_last: bool, fixed) -> _LibraryRun | None:
    """``node`` run alone on tensors of its arguments' layouts, with the arguments inductor copies into those
    layouts before the call, or makes in them (None when an argument's value is unknown). ``fixed``: whether an
    argument's layout is fixed before the call (:func:`_laid_out`)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    inputs: dict[str, TensorLayout] = {}
    laid_out: dict[str, fx.Node] = {}
    made: dict[str, fx.Node] = {}

    def described(arg: fx.Node) -> Any:
        value = arg.meta.get("val")
        if not isinstance(value, torch.Tensor):
            if isinstance(value, torch.SymInt):
                return hint(value)
            raise LookupError(arg.name)
        shape = tuple(hint(s) for s in value.shape)
        stride = tuple(hint(s) for s in value.stride())
        if channels_last and node.target in CONVOLUTION_OPS and len(shape) == 4 and _dense(value):
            stride = tuple(make_channels_last_strides_for(shape))
        name = f"t{len(inputs)}"
        inputs[name] = TensorLayout(shape, tuple(stride), str(value.dtype).removeprefix("torch."))
        (laid_out if fixed(arg) else made)[name] = arg
        return (_TENSOR, name)

    try:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), described)
    except LookupError:
        return None
    copied: list[tuple[fx.Node, int]] = []
    layouts: dict[fx.Node, tuple[int, ...]] = {}
    if node.target in CONVOLUTION_OPS:  # channels-last, a fused kernel makes its arguments channels-last
        if not (channels_last and len(inputs["t0"].shape) == 4):
            copies = _lowered_convolution_layouts(node.target, args, inputs, set(laid_out))
            copied = [(laid_out.get(name) or made[name], nbytes) for name, nbytes in copies.items()]
        layouts = {arg: inputs[name].stride for name, arg in made.items()}
    target = node.target
    key = f"{target}{args}{kwargs}{sorted((n, tuple(layout.__dict__.values())) for n, layout in inputs.items())}"

    def run(tensors: dict[str, torch.Tensor]) -> Any:
        def real(value: Any) -> Any:
            return tensors[value[1]] if isinstance(value, tuple) and value[:1] == (_TENSOR,) else value
        is_tensor = lambda v: isinstance(v, tuple) and v[:1] == (_TENSOR,)  # noqa: E731
        from torch.utils._pytree import tree_map  # noqa: PLC0415
        return target(*tree_map(real, args, is_leaf=is_tensor), **tree_map(real, kwargs, is_leaf=is_tensor))

    return _LibraryRun(KernelRun(key, inputs, run), copied, layouts)
