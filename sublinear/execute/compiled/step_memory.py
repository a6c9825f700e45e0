"""The memory of one training step as inductor compiled it: the forward's and backward's wrappers walked over one set
of storages (:mod:`.wrapper`), each library call's own allocations measured on the device
(:mod:`sublinear.profiling.kernels`), and autograd's copy of each gradient whose layout differs from its parameter's.

The step: the caller holds the parameters, buffers and inputs; forward runs and returns the outputs and what
backward reads (a saved value may be a parameter, or a copy of one in another layout, which is memory of its own);
autograd hands backward those saved values and the outputs' gradients, and backward frees each after its last use;
the gradients it returns become the parameters' ``.grad``. A gradient whose strides differ from its parameter's is
copied into the parameter's layout (autograd's layout contract), one at a time, while the others are still held.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from sublinear.execute.compiled.wrapper import (
    CALLER, RETURNED, CallMemory, Layout, LibraryCall, Statement, StepWalk, parse_wrapper,
)
from sublinear.tensors import size_hint as hint
from sublinear.profiling.kernels import KernelMemory, KernelRun, TensorLayout, blas_workspace_bytes, runs_cublaslt
from sublinear.training import held_to_end

__all__ = ["CompiledStepMemory", "TracePoint", "compiled_step_memory"]


@dataclass(frozen=True)
class CompiledStepMemory:
    """Bytes live in one compiled training step, parameters, buffers, inputs and cuBLAS's workspaces included: its
    peak and where it is (``where``: "forward", "backward" or "gradients"), forward's peak, what forward leaves for
    backward and the caller (``forward_end``), backward's peak, and the step's end (with the gradients)."""

    peak: int
    where: str
    forward_peak: int
    forward_end: int
    backward_peak: int
    end: int
    peak_at: str = ""  # the wrapper statement at the peak (a buffer, or a library call's result)
    trace: tuple[TracePoint, ...] = ()


@dataclass(frozen=True)
class TracePoint:
    """The bytes live at one wrapper statement of the step, in ``phase`` ("forward" or "backward"), the nodes
    of the partitioned graphs it computes (a buffer's origins, a library call's result's or its own node; empty:
    unknown), and whether it is a library call."""

    phase: str
    live: int
    nodes: tuple[str, ...]
    call: bool = False


def _dtype(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def _layout(value, sizes: Mapping[str, int]) -> Layout | None:
    if not isinstance(value, torch.Tensor):
        return None
    return Layout(tuple(hint(s) for s in value.shape), tuple(hint(s) for s in value.stride()), _dtype(value))


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


Origins = Mapping[str, Mapping[str, Sequence[str]]]  # per phase: buffer name -> the graph nodes it computes


def compiled_step_memory(forward: tuple[fx.GraphModule, str], backward: tuple[fx.GraphModule, str],
                         sizes: Mapping[str, int] | None = None, kernels: KernelMemory | None = None,
                         origins: Origins | None = None, uses: Sequence[str] = ()) -> CompiledStepMemory | None:
    """The step's memory from the compiled forward and backward (each its graph and wrapper source). ``sizes``: the
    value of each size symbol the wrappers name. ``kernels``: where library calls are measured (None: they hold
    nothing beyond their results). ``origins``: per phase, the nodes each buffer computes; given, the result's
    ``trace`` says what is live at every statement. ``uses``: per tensor output of the graph, what the call does
    with it; one it drops is released when forward returns (the others are held through backward). None when a
    wrapper is not in the form :func:`parse_wrapper` reads."""
    (fw_gm, fw_source), (bw_gm, bw_source) = forward, backward
    fw_statements, bw_statements = parse_wrapper(fw_source), parse_wrapper(bw_source)
    if fw_statements is None or bw_statements is None:
        return None
    sizes = dict(sizes or {})
    measure = None
    if kernels is not None:
        runs = _runs(fw_gm, fw_statements, bw_gm, bw_statements, sizes)
        kernels.measure(runs)
        measure = _lookup(kernels, sizes)
    return _walk(fw_gm, fw_statements, bw_gm, bw_statements, sizes, measure, origins, uses)


def _walk(fw_gm, fw_statements, bw_gm, bw_statements, sizes, measure, origins: Origins | None = None,
          uses: Sequence[str] = ()) -> CompiledStepMemory:
    trace: list[TracePoint] = []
    phase = ["forward"]

    def listen(statement: Statement, live: int) -> None:
        call, made = statement.call, origins.get(phase[0], {})
        if call is not None and statement.name not in made:  # a call writing into a buffer made before it
            nodes = (call.node,) if call.node else call.source_nodes
        else:
            nodes = made.get(statement.name, ())
        trace.append(TracePoint(phase[0], live, tuple(nodes), call is not None))

    walk = StepWalk(sizes, measure, listen if origins is not None else None)
    storages: dict[int, int] = {}  # untyped storage -> walk storage (parameters and inputs sharing one count once)
    arguments = []
    primals = _placeholders(fw_gm)
    for node in primals:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            st = value.untyped_storage()
            if st._cdata not in storages:
                storages[st._cdata] = walk.storage(hint(st.nbytes()))
            arguments.append((storages[st._cdata], _layout(value, sizes)))
        else:
            arguments.append((None, None))
    device = next((v.device for n in primals if isinstance(v := n.meta.get("val"), torch.Tensor)), None)
    lt = runs_cublaslt(n.target for gm in (fw_gm, bw_gm) for n in gm.graph.nodes)
    workspaces = blas_workspace_bytes(device, lt) if device is not None else 0
    if workspaces:
        walk.storage(workspaces)  # cuBLAS's workspaces, held by the caller through the step
    fw = walk.walk(fw_statements, arguments)
    inputs = _placeholders(bw_gm)
    tangents = [n for n in inputs if n.name.startswith("tangents")]
    saved = len(inputs) - len(tangents)
    returned = list(zip(fw.returned, fw.returned_layouts))[len(fw.returned) - saved:] if saved else []
    _drop_outputs(walk, fw.returned[:len(fw.returned) - saved], uses, {key for key, _ in returned})
    bw_arguments, handed = [], []
    for node, (key, layout) in zip(inputs[:saved], returned):
        bw_arguments.append((key, layout or _layout(node.meta.get("val"), sizes)))
        if key is not None:
            handed.append(key)
    for node in tangents:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            key = walk.storage(hint(value.untyped_storage().nbytes()), "<returned>")
            handed.append(key)
            bw_arguments.append((key, _layout(value, sizes)))
        else:
            bw_arguments.append((None, None))
    phase[0] = "backward"
    bw = walk.walk(bw_statements, bw_arguments, handed)
    copies = _layout_copies(primals, bw.returned_layouts, sizes)
    gradients = bw.end + max(copies, default=0)
    peak, where, at = max((fw.peak, "forward", fw.peak_at), (bw.peak, "backward", bw.peak_at),
                          (gradients, "gradients", ""))
    return CompiledStepMemory(peak, where, fw.peak, fw.end, bw.peak, bw.end, at, tuple(trace))


def _drop_outputs(walk: StepWalk, outputs: Sequence[int | None], uses: Sequence[str], saved: set[int]) -> None:
    """Release the user outputs the call lets go before backward (the last ``len(uses)`` tensors before the saved
    values; dropped, or passed to a later graph) unless backward gets them too. The caller holds the others to the
    step's end, also where forward saved the same storage for backward (a key/value cache the model returns and
    its attention's backward reads): backward freeing its saved values does not free them."""
    tensors = [key for key in outputs if key is not None]
    for key, use in zip(tensors[len(tensors) - len(uses):] if uses else [], uses):
        if held_to_end(use):
            walk.holders[key].add(CALLER)
        elif key not in saved:
            walk.release(key, RETURNED)


def _layout_copies(primals: Sequence[fx.Node], gradients: Sequence[Layout | None],
                   sizes: Mapping[str, int]) -> list[int]:
    """Bytes of each gradient autograd copies into its parameter's layout: its strides differ from the
    parameter's, which is dense."""
    copies = []
    for node, gradient in zip(primals, gradients):
        value = node.meta.get("val")
        if gradient is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
            continue
        parameter = _layout(value, sizes)
        if parameter.shape == gradient.shape and parameter.stride != gradient.stride and _dense(parameter):
            copies.append(parameter.nbytes)
    return copies


def _dense(layout: Layout) -> bool:
    size = 1
    for s in layout.shape:
        size *= s
    return layout.nbytes == size * layout.itemsize


# --- Library calls as the wrappers make them, for measuring -----------------------------------------------------

_NAMESPACE_NAMES = frozenset({"extern_kernels", "torch", "reinterpret_tensor"})


def _namespace() -> dict:
    from torch._inductor.select_algorithm import extern_kernels  # noqa: PLC0415

    return {"extern_kernels": extern_kernels, "torch": torch,
            "reinterpret_tensor": torch._C._dynamo.guards._reinterpret_tensor}


def kernel_run(call: LibraryCall, layouts: Mapping[str, Layout], sizes: Mapping[str, int]) -> KernelRun | None:
    """``call`` as a :class:`KernelRun` on tensors of ``layouts`` (None when it names something else)."""
    tree = ast.parse(call.text, mode="eval")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    tensors = {n for n in names if n in layouts}
    if names - tensors - sizes.keys() - _NAMESPACE_NAMES:
        return None

    class Keyed(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in tensors:
                layout = layouts[node.id]
                return ast.Constant(f"{layout.dtype}{list(layout.shape)}{list(layout.stride)}")
            if node.id in sizes:
                return ast.Constant(sizes[node.id])
            return node

    code = compile(tree, "<sublinear library call>", "eval")
    key = ast.unparse(Keyed().visit(ast.parse(call.text, mode="eval")))
    inputs = {n: TensorLayout(layouts[n].shape, layouts[n].stride, layouts[n].dtype) for n in tensors}
    namespace = {**_namespace(), **{n: sizes[n] for n in names if n in sizes}}
    return KernelRun(key, inputs, lambda tensors: eval(code, {**namespace, **tensors}))  # noqa: S307


def _runs(fw_gm, fw_statements: list[Statement], bw_gm, bw_statements: list[Statement],
          sizes: Mapping[str, int]) -> list[KernelRun]:
    """Every library call of the step, as the walk meets it (a dry walk records each call's layouts)."""
    runs: list[KernelRun] = []

    def record(call: LibraryCall, layouts: Mapping[str, Layout]) -> CallMemory:
        run = kernel_run(call, layouts, sizes)
        if run is not None:
            runs.append(run)
        return CallMemory(0)

    _walk(fw_gm, fw_statements, bw_gm, bw_statements, sizes, record)
    return runs


def _lookup(kernels: KernelMemory, sizes: Mapping[str, int]):
    def measure(call: LibraryCall, layouts: Mapping[str, Layout]) -> CallMemory:
        run = kernel_run(call, layouts, sizes)
        measured = kernels.get(run.key) if run is not None else None
        return CallMemory(measured.inside_peak, measured.result_dtypes) if measured else CallMemory(0)
    return measure
