"""The eager step traced: one training step of a captured graph run on fake tensors, every storage an aten op
returns tracked until it dies, and each allocation and free attributed to the forward node or backward autograd node
running (:class:`StorageEvent`).

The fakes are made from the graph's own input values (parameters included) in a fresh ``FakeTensorMode``, on the
values' own devices: device constants, ``.to(device)`` and tensors created in forward behave as in the real step, and
no memory is used. Views and in-place results alias their base (:mod:`.tracking`), so a storage saved for backward
and also kept for another reason counts once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph, FakeTwin, describe_node
from sublinear.core.profile import AutocastState
from sublinear.execute.program import NodeProgram
from sublinear.profiling.costs import aten_work, computes_in_half, spec_tree
from sublinear.profiling.tracking import StorageTracker
from sublinear.tensors import autocast_state, storage_key
from sublinear.training import (DROPPED, GRADIENT, HELD, gradient_receivers, held_to_end, receives_gradient,
                                step_backward)

__all__ = ["ProfileError", "StepTrace", "StorageEvent", "trace_step"]

_COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional", "_dtensor"})
# Batch-norm kernels update running_mean/var (args 3 and 4) when training (arg 5) without declaring the write in
# their schema or bumping version counters.
_BATCH_NORMS = frozenset(getattr(torch.ops.aten, name) for name in (
    "native_batch_norm", "batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm",
    "_native_batch_norm_legit", "_batch_norm_with_update"))


class ProfileError(RuntimeError):
    """The profiled step failed at a node; the message names the node, its module path and source line."""


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an aten call writes in place."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    if func._overloadpacket in _BATCH_NORMS and len(args) > 5 and args[5] is True:
        written.extend(t for t in args[3:5] if isinstance(t, torch.Tensor))
    return written


class StorageEvent(NamedTuple):
    """One allocation or free during the profiled step, and where it happened."""

    backward: bool  # during backward
    context: int  # the forward node running, or the backward autograd node's sequence number (-1: none)
    kind: str  # "alloc" or "free"
    serial: int  # the storage's number in allocation order (-1: a storage allocated before tracking began)
    nbytes: int


class _StepRecorder(StorageTracker):
    """Storage tracker that attributes every allocation and free to a forward node or a backward autograd node,
    with FLOPs and bytes moved per forward node and per backward autograd node."""

    def __init__(self) -> None:
        super().__init__(listener=self._on_event)
        self.node: int | None = None  # forward node being executed
        self.backward = False
        self.events: list[StorageEvent] = []
        self.serial: dict[int, int] = {}
        self.serial_bytes: list[int] = []
        self.random_nodes: set[int] = set()
        self.comm_nodes: set[int] = set()
        self.writes: dict[int, list[int]] = defaultdict(list)  # node -> serials written in place
        self.flops: dict[int, int] = defaultdict(int)  # node -> forward FLOPs (torch.utils.flop_counter's formulas)
        self.half_flops: dict[int, int] = defaultdict(int)  # node -> those of its FLOPs computed in half precision
        self.io_bytes: dict[int, int] = defaultdict(int)  # node -> bytes its aten calls read and write
        self.calls: dict[int, int] = defaultdict(int)  # node -> aten calls
        # per backward aten call: (sequence nr, FLOPs, bytes, whether it computes in half precision)
        self.backward_work: list[tuple[int, int, int, bool]] = []
        self.state_serials: set[int] = set()
        self.backward_flops = 0
        self.autocast_cached: set[int] = set()  # casts of parameters that autocast's cache holds until forward ends
        self.ops: set = set()  # every aten overload the step called, forward and backward

    def serial_of(self, t: torch.Tensor) -> int:
        return self.serial[t.untyped_storage()._cdata]

    def _context(self) -> int:
        if not self.backward:
            return -1 if self.node is None else self.node
        node = torch._C._current_autograd_node()
        return -1 if node is None else node._sequence_nr()

    def _on_event(self, kind: str, key: int, nbytes: int) -> None:
        if kind == "alloc":
            self.serial[key] = len(self.serial_bytes)
            self.serial_bytes.append(nbytes)
            serial = self.serial[key]
        else:
            serial = self.serial.pop(key, -1)
        self.events.append(StorageEvent(self.backward, self._context(), kind, serial, nbytes))

    def on_op(self, func, args, kwargs, out) -> None:
        self.ops.add(func)
        flops, moved = aten_work(func, args, kwargs, out)
        if self.backward:
            self.backward_flops += flops
            self.backward_work.append((self._context(), flops, moved, computes_in_half(out)))
            return
        if self.node is None:
            return
        if (func is torch.ops.aten._to_copy.default and torch.is_autocast_cache_enabled()
                and isinstance(args[0], torch.Tensor) and args[0].untyped_storage()._cdata in self.serial
                and self.serial_of(args[0]) in self.state_serials and args[0].requires_grad):
            self.autocast_cached.update(self.serial_of(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                        and t.untyped_storage()._cdata in self.serial)
        self.flops[self.node] += flops
        if computes_in_half(out):
            self.half_flops[self.node] += flops
        self.io_bytes[self.node] += moved
        self.calls[self.node] += 1
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random_nodes.add(self.node)
        if func.namespace in _COMMUNICATION_NAMESPACES:
            self.comm_nodes.add(self.node)
        for t in _written_tensors(func, args, kwargs):
            if t.untyped_storage()._cdata in self.serial:
                self.writes[self.node].append(self.serial_of(t))


@dataclass
class StepTrace:
    """One traced step: its program, the recorder's events, and per node its outputs, saves, modes and inputs;
    storages are named by their serials (indices into ``recorder.serial_bytes``)."""

    program: NodeProgram
    recorder: _StepRecorder
    node_out: dict[int, list[int]]  # node -> serial of each tensor leaf of its output (-1: untracked)
    node_saved: dict[int, list[int]]  # node -> serials autograd saved while it ran
    node_seq: list[tuple[int, int]]  # (first sequence number, node) in creation order
    node_modes: dict[int, tuple[bool, AutocastState]]  # node -> grad mode and autocast state it ran under
    node_inputs: dict[int, tuple[Any, Any]]  # node -> its args and kwargs as TensorSpec trees
    state_serials: dict[int, str]  # serial -> "parameter"/"buffer"/"input"
    output_serials: set[int]  # outputs the caller holds past forward
    dropped_serials: set[int]  # outputs the caller lets go before backward: the graph holds them until it returns
    output_uses: tuple[str, ...]  # what the step did with each tensor output (see profile())
    gradient_sizes: list[int]  # bytes of each parameter gradient's storage after backward
    output_keys: tuple[int, ...] = ()  # per tensor output, its storage's serial (-1: untracked)
    saved_inputs: tuple[bool, ...] = ()  # per graph input: autograd saved a storage of it


def _profiling_device(values: Sequence[Any]) -> torch.device | None:
    """Where fakes must live: the values' device, except that meta values under autocast become fakes on the
    autocast device (autocast dispatches on the device, and meta has none)."""
    devices = {t.device for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)}
    if devices and all(d.type == "meta" for d in devices):
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                return torch.device(device)
    return None


def trace_step(graph: CapturedGraph, values: Sequence[Any], keep_inputs: bool,
               uses: Sequence[str] | None) -> StepTrace:
    """Run ``graph``'s forward and backward once on fakes of ``values``, every storage tracked. ``keep_inputs``:
    record each node's arguments (to time it alone); ``uses``: per tensor output, what the step does with it
    (None: :func:`~sublinear.training.gradient_receivers` get a gradient, the rest are held). Raises
    :class:`ProfileError` when a node fails on the fakes."""
    twin = FakeTwin()
    inputs = twin.value(list(values), _profiling_device(values))
    program = NodeProgram(graph.graph_module)
    recorder = _StepRecorder()
    state_serials: dict[int, str] = {}
    recorder.listener = None
    for kind, value in zip(graph.kinds, inputs):
        for t in (leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)):
            key = t.untyped_storage()._cdata
            if key not in recorder.live:
                recorder.track([t])
                recorder.serial[key] = len(recorder.serial_bytes)
                recorder.serial_bytes.append(recorder.live[key])
                state_serials[recorder.serial[key]] = kind if kind in (PARAMETER, BUFFER) else INPUT
                recorder.state_serials.add(recorder.serial[key])
    recorder.listener = recorder._on_event

    node_out: dict[int, list[int]] = {
        i: [recorder.serial_of(t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        for i, v in zip(program.placeholders, inputs)}
    node_saved: dict[int, list[int]] = defaultdict(list)
    node_seq: list[tuple[int, int]] = []
    node_modes: dict[int, tuple[bool, AutocastState]] = {}
    node_inputs: dict[int, tuple[Any, Any]] = {}

    def before(i: int, env: list[Any]) -> None:
        recorder.node = i
        node_seq.append((torch._C._autograd._get_sequence_nr(), i))
        node_modes[i] = (torch.is_grad_enabled(), autocast_state())
        if keep_inputs:
            node_inputs[i] = spec_tree(program.arguments(i, env))

    def after(i: int, value: Any) -> None:
        node_out[i] = [recorder.serial[key] if (key := storage_key(t)) in recorder.serial else -1
                       for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        recorder.node = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if recorder.node is not None and (key := storage_key(t)) in recorder.serial:
            node_saved[recorder.node].append(recorder.serial[key])
        return t.detach()

    with twin.mode, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            outputs = program.run(inputs, after=after, before=before)
        except Exception as exc:
            node = program.nodes[recorder.node] if recorder.node is not None else None
            where = describe_node(node) if node is not None else "the graph's inputs"
            raise ProfileError(f"sublinear could not profile the step: {where} failed on fake tensors: "
                               f"{type(exc).__name__}: {exc}") from exc
        torch.clear_autocast_cache()  # the step's forward ends here, as when `with torch.autocast()` exits
        node_seq.append((torch._C._autograd._get_sequence_nr(), -1))
        outputs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        if uses is None:
            uses = tuple(GRADIENT if r else HELD for r in gradient_receivers(outputs))
        output_keys = tuple(recorder.serial.get(t.untyped_storage()._cdata, -1) for t in outputs)
        dropped_serials = {s for s, use in zip(output_keys, uses) if s >= 0 and not held_to_end(use)}
        output_serials = {s for s, use in zip(output_keys, uses) if s >= 0 and held_to_end(use)}
        outputs = [t for t, use in zip(outputs, uses) if use != DROPPED]  # the caller lets the others go now
        receives = [receives_gradient(use) for use in uses if use != DROPPED]
        recorder.backward = True  # the output gradients step_backward makes belong to the backward
        step_backward(outputs, receives)
        recorder.backward = False
        leaves = [t for kind, v in zip(graph.kinds, inputs) if kind == PARAMETER
                  for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        gradient_sizes = [st.nbytes() for st in {p.grad.untyped_storage()._cdata: p.grad.untyped_storage()
                                                 for p in leaves if p.grad is not None}.values()]
    del outputs
    saved = {s for serials in node_saved.values() for s in serials}
    saved_inputs = tuple(any(s in saved for s in node_out[i]) for i in program.placeholders)
    return StepTrace(program, recorder, node_out, dict(node_saved), node_seq, node_modes, node_inputs, state_serials,
                     output_serials, dropped_serials, tuple(uses), gradient_sizes, output_keys, saved_inputs)
