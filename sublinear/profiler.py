"""Profile: run one eager training step of a captured graph on the meta device and record, per operator, what
the simulator and rewriter need.

Units of planning are *ops*: contiguous runs of fx operator nodes that must stay in one block because a node
mutates in place a storage that an earlier node of the run produced (``ReLU(inplace=True)``, ``out += x``,
item assignment). Across op boundaries, therefore, a storage is never written again once produced.

Everything is counted per storage, so views and in-place results alias their base (trap 4), and a storage that
autograd saves and that is also kept for another reason is one storage (trap 8).
"""

from __future__ import annotations

import bisect
import copy
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from .tracer import CapturedGraph
from .interpret import NodeProgram
from .sharding import ShardedParameters
from .tracking import StorageTracker

__all__ = ["GraphProfile", "NodeFacts", "OpProfile", "profile", "default_loss", "meta_twin", "training_step"]

_COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional", "_dtensor"})
# Batch-norm kernels update running_mean/var (args 3 and 4) when training (arg 5) without declaring the write in
# their schema or bumping version counters.
_BATCH_NORMS = frozenset(getattr(torch.ops.aten, name) for name in (
    "native_batch_norm", "batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm",
    "_native_batch_norm_legit", "_batch_norm_with_update"))


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


def default_loss(outputs: Any) -> torch.Tensor | None:
    """The loss of the canonical step: the sum of every floating output that requires grad (None if none)."""
    parts = [t.sum() for t in tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def training_step(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The step every prediction describes: forward, then backward of :func:`default_loss` while the outputs are
    still held (as ``out = model(x); loss_fn(out).backward()`` does)."""
    outputs = module(*args, **kwargs)
    loss = default_loss(outputs)
    if loss is not None:
        loss.backward()
    return outputs


@dataclass(frozen=True)
class NodeFacts:
    """What the rewriter must know about one operator node to recompute it exactly."""

    random: bool = False
    state_attrs: tuple[str, ...] = ()  # call_module: own parameters/buffers it writes (snapshot, then redirect)
    state_args: tuple[int | str, ...] = ()  # other nodes: positions/names of tensor args whose state it writes
    pin_reason: str = ""  # non-empty: the node must never be recomputed


@dataclass(frozen=True)
class OpProfile:
    """One planning unit: node positions ``nodes`` (contiguous operators of the program)."""

    index: int
    nodes: tuple[int, ...]
    name: str
    flops: int
    forward_extra_bytes: int  # most bytes the op's own allocations hold at once while it runs
    snapshot_bytes: int  # state it writes, cloned in forward when the op may be recomputed
    random: bool
    mutates_state: bool
    pin_reason: str

    @property
    def pinned(self) -> bool:
        return bool(self.pin_reason)


@dataclass
class GraphProfile:
    """The planner's view of one training step; plain numbers, no torch objects.

    Storages are indexed 0..S-1. ``storage_last_use[s]`` is the last op that reads a value on ``s`` in forward
    (``len(ops)`` for graph outputs); ``storage_saved_by[s]`` lists the ops whose autograd saves it; storages
    that neither outlive their op nor are saved are folded into ``forward_extra_bytes``.
    ``op_inputs[o]`` lists, per value op ``o`` reads from another op, ``(producer op, storages of the value)``.
    """

    ops: list[OpProfile]
    storage_bytes: np.ndarray
    storage_producer: np.ndarray
    storage_last_use: np.ndarray
    storage_saved_by: list[tuple[int, ...]]
    op_inputs: list[tuple[tuple[int, tuple[int, ...]], ...]]
    baseline_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    measured_peak_bytes: int
    backward_flops: int
    node_facts: dict[int, NodeFacts] = field(default_factory=dict)
    op_of_node: dict[int, int] = field(default_factory=dict)
    node_storages: dict[int, tuple[int, ...]] = field(default_factory=dict)  # node -> storage per tensor leaf (-1: none)
    reaches_output: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per op
    op_storages: list[tuple[int, ...]] = field(default_factory=list)  # per op: storages of the values it outputs
    held_through_forward: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # autocast's cast cache
    # Backward runs node by node: operator nodes ("ranks", in program order) with their op, the ranks whose autograd
    # saves each storage, and per rank the gradient-side bytes at the start of its backward, at the peak before it
    # frees what it saved, and at the peak after that (plan-independent, from the eager step).
    storage_saved_at: list[tuple[int, ...]] = field(default_factory=list)
    node_op: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    grad_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    grad_peak: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    grad_after_release: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sharding: ShardedParameters | None = None  # FSDP2's per-rank layout; None: full parameters and gradients

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def step_flops(self) -> int:
        """FLOPs of one eager training step (forward and backward)."""
        return self.forward_flops + self.backward_flops

    def summary(self, top: int = 5) -> str:
        mib = 2**20
        order = np.argsort(-self.storage_bytes)[:top]
        lines = [f"{self.num_ops} ops, forward {self.forward_flops / 1e9:.2f} GFLOP, eager step peak "
                 f"{self.measured_peak_bytes / mib:.1f} MiB (parameters {self.parameter_bytes / mib:.1f}, "
                 f"buffers {self.buffer_bytes / mib:.1f}, inputs {self.input_bytes / mib:.1f}, "
                 f"gradients {self.gradient_bytes / mib:.1f} MiB)"]
        for s in order:
            op = self.ops[self.storage_producer[s]]
            lines.append(f"  {self.storage_bytes[s] / mib:9.2f} MiB  from {op.name}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Twins: copies of the model whose tensors hold no data


class _Twin:
    """Turns real tensors into data-less ones: meta tensors, or fake tensors on ``device`` when autocast must
    apply (autocast dispatches on the device, and meta tensors have none)."""

    def __init__(self, device: str | None = None) -> None:
        self.device = device
        self.mode = FakeTensorMode(allow_non_fake_inputs=True) if device else None
        if self.mode is not None:
            self.mode.cache_enabled = False  # its dispatch cache keeps tensors alive past their last use

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        else:
            with self.mode:
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
        if isinstance(t, nn.Parameter):
            return nn.Parameter(empty, requires_grad=t.requires_grad)
        return empty.requires_grad_(t.requires_grad) if t.is_leaf and t.is_floating_point() else empty

    def value(self, value: Any) -> Any:
        return tree_map(lambda v: self.tensor(v) if isinstance(v, torch.Tensor) else v, value)

    def modules(self, module: nn.Module, *extra: Any) -> tuple[nn.Module, ...]:
        """Deep copies of ``module`` (and of ``extra`` objects sharing its submodules) with data-less tensors.

        No tensor data is copied; submodule sharing between ``module`` and ``extra`` is preserved.
        """
        memo: dict[int, Any] = {}
        for owner in [module, *extra]:
            for sub in owner.modules():
                for value in itertools.chain(sub._parameters.values(), sub._buffers.values(),
                                             (v for v in vars(sub).values() if isinstance(v, torch.Tensor))):
                    if value is not None and id(value) not in memo:
                        memo[id(value)] = self.tensor(value)
        try:
            return copy.deepcopy((module, *extra), memo)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"sublinear plans on a data-less copy of the model, and copying "
                               f"{type(module).__name__} failed: {exc}") from exc

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)


def meta_twin(module: nn.Module, *extra: Any) -> tuple[nn.Module, ...]:
    """Meta-device deep copies of ``module`` (and ``extra``), sharing submodules as the originals do."""
    return _Twin().modules(module, *extra)


def _autocast_device() -> str | None:
    """The device type whose autocast is on, if any (CUDA first)."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device
    return None


# ---------------------------------------------------------------------------------------------------------------
# Tracing the eager step


class _StepRecorder(StorageTracker):
    """Storage tracker that attributes every allocation and free to a forward node or a backward autograd node."""

    def __init__(self) -> None:
        super().__init__(listener=self._on_event)
        self.node: int | None = None  # forward node being executed
        self.backward = False
        self.events: list[tuple[bool, int, str, int, int]] = []  # (backward?, context, kind, serial, nbytes)
        self.serial: dict[int, int] = {}
        self.serial_bytes: list[int] = []
        self.random_nodes: set[int] = set()
        self.comm_nodes: set[int] = set()
        self.writes: dict[int, list[int]] = defaultdict(list)  # node -> serials written in place
        self.flops: dict[int, int] = defaultdict(int)  # node -> forward FLOPs (torch.utils.flop_counter's formulas)
        self.state_serials: set[int] = set()
        self.backward_flops = 0
        self.autocast_cached: set[int] = set()  # casts of parameters that autocast's cache holds until forward ends

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
        self.events.append((self.backward, self._context(), kind, serial, nbytes))

    def on_op(self, func, args, kwargs, out) -> None:
        if self.backward:
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                self.backward_flops += count(*args, **kwargs, out_val=out)
            return
        if self.node is None:
            return
        if (func is torch.ops.aten._to_copy.default and torch.is_autocast_cache_enabled()
                and isinstance(args[0], torch.Tensor) and args[0].untyped_storage()._cdata in self.serial
                and self.serial_of(args[0]) in self.state_serials and args[0].requires_grad):
            self.autocast_cached.update(self.serial_of(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                        and t.untyped_storage()._cdata in self.serial)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops[self.node] += count(*args, **kwargs, out_val=out)
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random_nodes.add(self.node)
        if func.namespace in _COMMUNICATION_NAMESPACES:
            self.comm_nodes.add(self.node)
        for t in _written_tensors(func, args, kwargs):
            if t.untyped_storage()._cdata in self.serial:
                self.writes[self.node].append(self.serial_of(t))


@dataclass
class _Trace:
    program: NodeProgram
    recorder: _StepRecorder
    node_out: dict[int, list[int]]  # node -> serial of each tensor leaf of its output (-1: untracked)
    node_saved: dict[int, list[int]]  # node -> serials autograd saved while it ran
    node_flops: dict[int, int]
    node_seq: list[tuple[int, int]]  # (first sequence number, node) in creation order
    state_serials: dict[int, str]  # serial -> "parameter"/"buffer"/"input"
    output_serials: set[int]
    module_state: dict[int, dict[int, str]]  # call_module node -> serial -> attribute name
    gradient_bytes: int


def _trace_step(captured: CapturedGraph, args, kwargs) -> _Trace:
    twin = _Twin(_autocast_device())
    module, gm = twin.modules(captured.module, captured.graph_module)
    program = NodeProgram(gm, root=module)
    inputs = twin.value(captured.placeholder_values(args, kwargs))
    recorder = _StepRecorder()
    state_serials: dict[int, str] = {}
    recorder.listener = None
    for kind, tensors in (("parameter", list(module.parameters())), ("buffer", list(module.buffers())),
                          ("input", [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)])):
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key not in recorder.live:
                recorder.track([t])
                recorder.serial[key] = len(recorder.serial_bytes)
                recorder.serial_bytes.append(recorder.live[key])
                state_serials[recorder.serial[key]] = kind
                recorder.state_serials.add(recorder.serial[key])
    recorder.listener = recorder._on_event

    module_state = {}
    for i in program.operators:
        node = program.nodes[i]
        if node.op == "call_module":
            sub = module.get_submodule(node.target) if _has_submodule(module, node.target) else None
            if sub is not None:
                module_state[i] = {recorder.serial_of(t): name for name, t in
                                   itertools.chain(sub.named_parameters(), sub.named_buffers())
                                   if t.untyped_storage()._cdata in recorder.serial}

    node_out: dict[int, list[int]] = {
        i: [recorder.serial_of(t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        for i, v in zip(program.placeholders, inputs)}
    node_saved: dict[int, list[int]] = defaultdict(list)
    node_seq: list[tuple[int, int]] = []

    def before(i: int) -> None:
        recorder.node = i
        node_seq.append((torch._C._autograd._get_sequence_nr(), i))

    def after(i: int, value: Any) -> None:
        node_out[i] = [recorder.serial_of(t) if t.untyped_storage()._cdata in recorder.serial else -1
                       for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        recorder.node = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if recorder.node is not None and t.untyped_storage()._cdata in recorder.serial:
            node_saved[recorder.node].append(recorder.serial_of(t))
        return t.detach()

    with twin, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = program.run(inputs, after=after, before=before)
        torch.clear_autocast_cache()  # the step's forward ends here, as when `with torch.autocast()` exits
        node_seq.append((torch._C._autograd._get_sequence_nr(), -1))
        output_serials = {recorder.serial_of(t) for t in tree_leaves(outputs)
                          if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in recorder.serial}
        loss = default_loss(outputs)
        if loss is not None:
            recorder.backward = True
            loss.backward()
            recorder.backward = False
        gradient_bytes = sum(p.grad.untyped_storage().nbytes() for p in module.parameters() if p.grad is not None)
    del outputs, loss
    return _Trace(program, recorder, node_out, dict(node_saved), dict(recorder.flops), node_seq, state_serials,
                  output_serials, module_state, gradient_bytes)


def _has_submodule(module: nn.Module, target: str) -> bool:
    try:
        module.get_submodule(target)
    except AttributeError:
        return False
    return True


def _distinct(items):
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------------------------
# From the trace to ops


def profile(captured: CapturedGraph, args=(), kwargs=None) -> GraphProfile:
    """Profile one forward+backward step of ``captured`` at the shapes of ``args``/``kwargs`` (real or meta)."""
    trace = _trace_step(captured, args, kwargs or {})
    program, rec = trace.program, trace.recorder
    operators = program.operators

    producer_node: dict[int, int] = {}
    for backward, ctx, kind, serial, _ in rec.events:
        if kind == "alloc" and not backward and ctx >= 0:
            producer_node[serial] = ctx

    facts = {i: _node_facts(i, trace, producer_node) for i in operators}
    _pin_readers_of_updated_state(facts, trace)
    groups = _merge_in_place_runs(operators, trace, producer_node)
    op_of_node = {node: o for o, group in enumerate(groups) for node in group}

    # Value reads, storage lifetimes and saves, at op granularity.
    value_serials = {i: _distinct(s for s in trace.node_out.get(i, []) if s >= 0) for i in range(len(program.nodes))}
    last_use: dict[int, int] = {}
    op_inputs: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in groups]
    for o, group in enumerate(groups):
        seen = set()
        for i in group:
            for j in program.inputs[i]:
                for s in value_serials[j]:
                    last_use[s] = max(last_use.get(s, -1), o)
                p = op_of_node.get(j)
                if p is not None and p != o and j not in seen:
                    seen.add(j)
                    op_inputs[o].append((p, tuple(value_serials[j])))
    n_ops = len(groups)
    for s in trace.output_serials:
        last_use[s] = n_ops
    saved_by: dict[int, set[int]] = defaultdict(set)
    saved_at: dict[int, set[int]] = defaultdict(set)  # serial -> operator ranks (positions) that save it
    rank = {node: r for r, node in enumerate(operators)}
    for i, serials in trace.node_saved.items():
        for s in serials:
            saved_by[s].add(op_of_node[i])
            saved_at[s].add(rank[i])

    # An op whose values never flow into the outputs has its autograd nodes freed in forward, with its outputs.
    reaches = [False] * len(program.nodes)
    for i in range(len(program.nodes) - 1, -1, -1):
        reaches[i] = any(u == program.output or reaches[u] for u in program.users[i])
    windows = _forward_windows(rec.events, op_of_node, n_ops)
    extra = _forward_extra(rec.events, windows, n_ops)
    rank_of_node = {node: r for r, node in enumerate(operators)}
    grad_start, grad_peak, grad_after = _backward_gradient_profile(rec.events, trace.node_seq, rank_of_node,
                                                                   len(operators))

    # Storages that can outlive the op that produced them.
    storages = sorted(s for s, node in producer_node.items()
                      if node in op_of_node and s not in trace.state_serials
                      and (last_use.get(s, -1) > op_of_node[node] or s in saved_by or s in rec.autocast_cached))
    sid = {s: k for k, s in enumerate(storages)}

    ops = []
    for o, group in enumerate(groups):
        node_facts = [facts[i] for i in group]
        snapshot = sum(rec.serial_bytes[s] for i in group for s in set(rec.writes.get(i, []))
                       if s in trace.state_serials)
        ops.append(OpProfile(
            index=o, nodes=tuple(group), name=_op_name(program, group),
            flops=sum(trace.node_flops.get(i, 0) for i in group),
            forward_extra_bytes=extra[o],
            snapshot_bytes=snapshot,
            random=any(f.random for f in node_facts),
            mutates_state=any(f.state_attrs or f.state_args for f in node_facts),
            pin_reason="; ".join(f.pin_reason for f in node_facts if f.pin_reason),
        ))

    def kind_bytes(kind: str) -> int:
        return sum(rec.serial_bytes[s] for s, k in trace.state_serials.items() if k == kind)

    return GraphProfile(
        ops=ops,
        storage_bytes=np.array([rec.serial_bytes[s] for s in storages], dtype=np.int64),
        storage_producer=np.array([op_of_node[producer_node[s]] for s in storages], dtype=np.int64),
        storage_last_use=np.array([max(last_use.get(s, -1), op_of_node[producer_node[s]]) for s in storages],
                                  dtype=np.int64),
        storage_saved_by=[tuple(sorted(saved_by.get(s, ()))) for s in storages],
        op_inputs=[tuple((p, tuple(sid[s] for s in ss if s in sid)) for p, ss in ins) for ins in op_inputs],
        baseline_bytes=kind_bytes("parameter") + kind_bytes("buffer") + kind_bytes("input"),
        parameter_bytes=kind_bytes("parameter"),
        buffer_bytes=kind_bytes("buffer"),
        input_bytes=kind_bytes("input"),
        gradient_bytes=trace.gradient_bytes,
        measured_peak_bytes=rec.peak_bytes,
        backward_flops=rec.backward_flops,
        node_facts=facts,
        op_of_node=op_of_node,
        node_storages={i: tuple(sid.get(s, -1) for s in trace.node_out.get(i, [])) for i in operators},
        reaches_output=np.array([any(reaches[i] for i in group) for group in groups], dtype=bool),
        op_storages=[tuple(sorted({sid[s] for i in group for s in trace.node_out.get(i, []) if s in sid}))
                     for group in groups],
        held_through_forward=np.array([s in rec.autocast_cached for s in storages], dtype=bool),
        storage_saved_at=[tuple(sorted(saved_at.get(s, ()))) for s in storages],
        node_op=np.array([op_of_node[i] for i in operators], dtype=np.int64),
        grad_start=np.array(grad_start, dtype=np.int64),
        grad_peak=np.array(grad_peak, dtype=np.int64),
        grad_after_release=np.array(grad_after, dtype=np.int64),
    )


def _node_facts(i: int, trace: _Trace, producer_node: dict[int, int]) -> NodeFacts:
    program, rec = trace.program, trace.recorder
    node = program.nodes[i]
    writes = set(rec.writes.get(i, []))
    state_writes = {s for s in writes if s in trace.state_serials}
    pin = []
    if i in rec.comm_nodes:
        pin.append(f"{node.name} communicates")
    attrs: tuple[str, ...] = ()
    arg_slots: tuple[int | str, ...] = ()
    if state_writes:
        if node.op == "call_module" and i in trace.module_state and state_writes <= set(trace.module_state[i]):
            attrs = tuple(sorted(trace.module_state[i][s] for s in state_writes))
        else:
            slots = _arg_slots_holding(node, program, trace, state_writes)
            if slots is None:
                pin.append(f"{node.name} writes state it does not receive as an argument")
            else:
                arg_slots = slots
    return NodeFacts(random=i in rec.random_nodes, state_attrs=attrs, state_args=arg_slots,
                     pin_reason="; ".join(pin))


def _pin_readers_of_updated_state(facts: dict[int, NodeFacts], trace: _Trace) -> None:
    """A node reading state that another node updates in place cannot be replayed later: pin it."""
    program, rec = trace.program, trace.recorder
    writers: dict[int, set[int]] = defaultdict(set)
    for i, serials in rec.writes.items():
        for s in serials:
            if s in trace.state_serials:
                writers[s].add(i)
    if not writers:
        return
    for i in facts:
        reads = set(trace.module_state.get(i, {}))
        for j in program.inputs[i]:
            reads.update(trace.node_out.get(j, []))
        others = {w for s in reads if s in writers for w in writers[s] if w != i}
        if others:
            names = ", ".join(sorted(program.nodes[w].name for w in others))
            reason = f"{program.nodes[i].name} reads state that {names} updates in place"
            old = facts[i]
            facts[i] = NodeFacts(old.random, old.state_attrs, old.state_args,
                                 "; ".join(r for r in (old.pin_reason, reason) if r))


def _arg_slots_holding(node, program: NodeProgram, trace: _Trace, serials: set[int]):
    """Positions/names of ``node``'s direct args whose storage is in ``serials``, if they cover all of them."""
    slots, covered = [], set()
    for slot, arg in itertools.chain(enumerate(node.args), node.kwargs.items()):
        if isinstance(arg, torch.fx.Node):
            mine = set(trace.node_out.get(program.index[arg], [])) & serials
            if mine:
                slots.append(slot)
                covered |= mine
    return tuple(slots) if covered == serials else None


def _merge_in_place_runs(operators: list[int], trace: _Trace, producer_node: dict[int, int]) -> list[list[int]]:
    """Group operator nodes so that every in-place write lands in the op that produced the storage."""
    position = {node: k for k, node in enumerate(operators)}
    reach = list(range(len(operators)))  # reach[k]: last operator position that must join k's group
    for node, serials in trace.recorder.writes.items():
        for s in serials:
            p = producer_node.get(s)
            if p is not None and p in position and node in position and p != node:
                a, b = position[p], position[node]
                reach[a] = max(reach[a], b)
    groups, current, end = [], [], -1
    for k, node in enumerate(operators):
        if current and k > end:
            groups.append(current)
            current = []
        current.append(node)
        end = max(end, reach[k])
    if current:
        groups.append(current)
    return groups


def _forward_windows(events, op_of_node, n_ops) -> list[tuple[int, int]]:
    first = [-1] * n_ops
    last = [-1] * n_ops
    for t, (backward, ctx, *_rest) in enumerate(events):
        if backward or ctx < 0 or ctx not in op_of_node:
            continue
        o = op_of_node[ctx]
        if first[o] < 0:
            first[o] = t
        last[o] = t
    return list(zip(first, last))


def _forward_extra(events, windows, n_ops) -> list[int]:
    """Per op: peak of bytes allocated inside the op and alive at once (frees of older storages ignored)."""
    extra = [0] * n_ops
    for o, (a, b) in enumerate(windows):
        if a < 0:
            continue
        mine: set[int] = set()
        live = peak = 0
        for backward, ctx, kind, serial, nbytes in events[a:b + 1]:
            if kind == "alloc":
                mine.add(serial)
                live += nbytes
                peak = max(peak, live)
            elif serial in mine:
                live -= nbytes
        extra[o] = peak
    return extra


def _backward_gradient_profile(events, node_seq, rank_of_node, n_ranks):
    """Per operator node (rank): gradient-side bytes (storages allocated in backward) at the start of its
    backward, at their peak before it frees the activations it saved, and at their peak after that.

    Autograd runs its nodes in decreasing sequence number, so each fx node's backward is one contiguous window;
    the first free of a forward storage inside it marks the release of what it saved. A node with no backward work
    sees the gradient side as the previous window left it.
    """
    starts = [s for s, _ in node_seq]
    nodes = [n for _, n in node_seq]

    def op_for(seq: int) -> int | None:
        k = bisect.bisect_right(starts, seq) - 1
        return None if k < 0 or seq >= 2**62 else rank_of_node.get(nodes[k])

    grad_live = 0
    born_in_backward: set[int] = set()
    start: list[int | None] = [None] * n_ranks
    before = [0] * n_ranks
    after = [0] * n_ranks
    released = [False] * n_ranks
    left = [0] * n_ranks  # gradient side when the op's window closed
    current: int | None = None
    for backward, ctx, kind, serial, nbytes in events:
        if not backward:
            continue
        o = op_for(ctx) if ctx >= 0 else None
        if o is not None and o != current:
            current = o
            if start[o] is None:
                start[o] = before[o] = after[o] = grad_live
        if kind == "alloc":
            born_in_backward.add(serial)
            grad_live += nbytes
        elif serial in born_in_backward:
            born_in_backward.discard(serial)
            grad_live -= nbytes
        elif current is not None:
            released[current] = True
        if current is not None:
            left[current] = grad_live
            if released[current]:
                after[current] = max(after[current], grad_live)
            else:
                before[current] = max(before[current], grad_live)
                after[current] = grad_live
    carried = 0
    for o in range(n_ranks - 1, -1, -1):
        if start[o] is None:
            start[o] = before[o] = after[o] = carried
        else:
            carried = left[o]
    return [int(v) for v in start], [int(v) for v in before], [int(v) for v in after]


def _op_name(program: NodeProgram, group: list[int]) -> str:
    first = program.module_path(group[0])
    return first if len(group) == 1 else f"{first} +{len(group) - 1}"
