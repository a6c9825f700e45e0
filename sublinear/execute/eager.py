"""Rewrite: run a captured graph so that only retained values survive forward and each block is rebuilt in backward.

The rewriter reads the plan's :class:`~sublinear.core.analysis.PlanAnalysis` (which ops each block's recompute
re-runs, which storages are retained, which node values a recompute reads from its frame) and never plans or re-derives
it. Mechanism (non-reentrant, so ``torch.autograd.grad``, DDP and retain_graph work): while an op of a block other
than the last runs, a saved-tensor hook stores every tensor autograd saves whose storage is retained, and replaces any
other by a handle:

- a *view handle* names the node whose output owns the storage and the view's size/stride/offset;
- an *order handle* names a storage created inside a node that no value owns (BatchNorm's saved mean, dropout's
  mask): the k-th tensor that node saves.

The first unpack of a block's handle re-runs the block's recompute closure, each node under the grad mode and
autocast state it ran with in forward, random nodes under their forward RNG state, and state writes redirected to
clones of the state as it was (BatchNorm running statistics are updated once, in forward). The rebuilt storages fill
every handle of the block, each checked against forward's shape and dtype; autograd frees each one after its node's
backward, as in eager.

The forward and each block's recompute run as Python code generated from the graph for the plan (straight-line
calls, values in locals freed after their last use), with bookkeeping calls only at the nodes of recomputed blocks.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import CapturedGraph
from sublinear.core.analysis import PlanAnalysis, StorageState, analyse
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, NodeFacts
from sublinear.execute.program import NodeProgram
from sublinear.tensors import autocast_context, storage_key

__all__ = ["RecomputeError", "RewrittenGraph", "rewrite"]

log = logging.getLogger("sublinear.execute.eager")


class RecomputeError(RuntimeError):
    """A block's recompute failed or gave something other than what forward saved; the message names the block,
    the node and what differs."""


def rewrite(graph: CapturedGraph, profile: GraphProfile, plan: Plan) -> RewrittenGraph:
    """A callable computing ``graph`` on its placeholder values that recomputes per ``plan``; a plan that
    recomputes nothing runs the graph's straight-line code (:class:`NodeProgram`), with no saved-tensor hooks."""
    schedule = _Schedule(graph, profile, analyse(profile, plan))
    if schedule.analysis.recomputed.any():
        return RewrittenGraph(schedule)
    program = schedule.program
    plain = program.define("graph", program.source("graph"))
    return RewrittenGraph(schedule, lambda *values: plain(values))


class _Schedule:
    """Per-node lookups of the plan's analysis, computed once per plan."""

    def __init__(self, graph: CapturedGraph, profile: GraphProfile, analysis: PlanAnalysis) -> None:
        self.analysis = analysis
        program = self.program = NodeProgram(graph.graph_module)
        if len(program.operators) != sum(len(op.nodes) for op in profile.ops):
            raise ValueError("profile and graph disagree on the operators; profile the same captured graph")
        n_nodes = len(program.nodes)
        self.op_of_node = [profile.op_of_node.get(i, -1) for i in range(n_nodes)]
        self.block_of_node = [int(analysis.block_of[o]) if o >= 0 else -1 for o in self.op_of_node]
        self.group_of_block = [int(g) for g in analysis.group_of]
        self.group_of_node = [self.group_of_block[b] if b >= 0 else -1 for b in self.block_of_node]
        self.recomputable = [o >= 0 and bool(analysis.recomputed[o]) for o in self.op_of_node]
        self.in_frame_block = [o >= 0 and bool(analysis.framed[o]) for o in self.op_of_node]
        blocks = analysis.plan.blocks()
        self.block_end = {profile.ops[ops[-1]].nodes[-1] for ops in blocks}
        self.group_end = {profile.ops[analysis.group_end[b]].nodes[-1] for b in range(len(blocks))}
        self.nodes_of_op = [op.nodes for op in profile.ops]
        self.op_names = [op.name for op in profile.ops]
        self.facts: dict[int, NodeFacts] = profile.node_facts
        # Ops whose values never reach the outputs: autograd frees what they save in forward; store it as is.
        self.stores_all = [o < 0 or not profile.reaches_output[o] for o in self.op_of_node]
        self.leaf_retained: dict[int, tuple[bool | None, ...]] = {
            i: tuple(bool(analysis.state[s] == StorageState.RETAINED) if s >= 0 else None for s in storages)
            for i, storages in profile.node_storages.items()}
        # Nodes whose outputs' storages some node saves (or that the profile could not follow): only their
        # storages need an owner when the forward runs, to tell a saved tensor's producer.
        self.owns_saved = [any(st < 0 or profile.storage_saved_by[st] for st in profile.node_storages.get(i, (-1,)))
                           for i in range(n_nodes)]
        self.node_retained = [True] * n_nodes
        for i, retained in analysis.node_retained.items():
            self.node_retained[i] = retained
        # Per block: the nodes its recompute re-runs (in order) and the values it reads from the frame.
        self.closure_nodes: list[list[int]] = []
        self.closure_inputs: list[set[int]] = []
        for members in analysis.closure:
            nodes = [i for o in members for i in self.nodes_of_op[o]]
            inside = set(nodes)
            self.closure_nodes.append(nodes)
            self.closure_inputs.append({j for i in nodes for j in program.inputs[i] if j not in inside})
        self.closure_ops = [set(members) for members in analysis.closure]
        self.num_blocks = len(blocks)
        # At each recomputable op's first node: the retained values its nodes read from other ops, which its
        # frame keeps for the recompute (they exist before the op starts, and inside a vmap region could not be
        # detached from their history later).
        self.frame_inputs: dict[int, list[int]] = {}
        for o, nodes in enumerate(self.nodes_of_op):
            if nodes and self.recomputable[nodes[0]]:
                reads = (j for node in nodes for j in program.inputs[node]
                         if self.op_of_node[j] != o and self.node_retained[j])
                self.frame_inputs[nodes[0]] = list(dict.fromkeys(reads))
        self.forward = program.define("forward", self._forward_source())
        self.recompute = [program.define(f"recompute_{b}", self._recompute_source(b)) for b in range(len(blocks))]

    def _forward_source(self) -> str:
        """``forward(call, values)``: the graph as straight-line code (:meth:`NodeProgram.source`); a node of a framed
        block tells ``call`` (a :class:`_ForwardCall`) what it reads before it runs and what it made after, so that
        the saved-tensor hook knows the running node."""
        program = self.program
        framed_block = [-1]  # the block whose frame the local ``frame`` holds

        def node_lines(i: int) -> list[str]:
            if program.nodes[i].op == "get_attr":
                return [f"    v{i} = {program.expression(i)}", f"    call._own([v{i}], -1)"]
            if not self.in_frame_block[i]:
                return [f"    v{i} = {program.expression(i)}"]
            lines = []
            if self.block_of_node[i] != framed_block[0]:
                lines.append(f"    frame = call._frame_for({i})")
                framed_block[0] = self.block_of_node[i]
            if self._prepares(i):
                read = sorted(set(program.inputs[i]).union(self.frame_inputs.get(i, ())))
                reads = ", ".join(f"{j}: v{j}" for j in read)
                lines.append(f"    call._prepare(frame, {i}, {{{reads}}})")
            lines += [f"    call.node = {i}", "    call.packs = 0", f"    v{i} = {program.expression(i)}",
                      "    call.node = -1"]
            if self.owns_saved[i]:
                lines.append(f"    call._own((v{i},), {i})")
            lines.append(f"    if call.pending: call._settle({i}, frame)")
            if i in self.block_end:
                lines.append(f"    call._end_block({i})")
                framed_block[0] = -1
            return lines

        return program.source("forward", node_lines, first="call, ")

    def _prepares(self, i: int) -> bool:
        """Whether :meth:`_ForwardCall._prepare` records anything for node ``i``: the values its op reads from its
        frame, its RNG state or a snapshot of the state it writes."""
        facts = self.facts.get(i)
        return self.recomputable[i] and (bool(self.frame_inputs.get(i)) or (
            facts is not None and (facts.random or bool(facts.state_args))))

    def _recompute_source(self, block: int) -> str:
        """``recompute_<block>(current, enter, replay, fill, by_node, inputs)``: the block's recompute closure as
        straight-line code. ``inputs`` holds the values it reads from its frame; per node it sets ``current`` (the
        node and its count of saved tensors, for the harvesting hook), enters the node's forward modes where they
        change, runs random and state-writing nodes through ``replay`` and hands outputs that handles view to
        ``fill``; values are freed after their last read."""
        program = self.program
        nodes = self.closure_nodes[block]
        last_read: dict[int, int] = {}
        for i in nodes:
            for j in program.inputs[i]:
                last_read[j] = i
        frees: dict[int, list[int]] = {}
        for j, i in last_read.items():
            frees.setdefault(i, []).append(j)
        lines = [f"def recompute_{block}(current, enter, replay, fill, by_node, inputs):"]
        lines += [f"    v{j} = inputs[{j}]" for j in sorted(self.closure_inputs[block])]
        mode = None
        for i in nodes:
            facts = self.facts.get(i)
            lines.append(f"    current[0] = {i}; current[1] = 0")
            node_mode = (True, ()) if facts is None else (facts.grad_enabled, facts.autocast)
            if node_mode != mode:
                lines.append(f"    enter({program.bind(node_mode)})")
                mode = node_mode
            if facts is not None and (facts.random or facts.state_args):
                reads = ", ".join(f"{j}: v{j}" for j in program.inputs[i])
                lines.append(f"    v{i} = replay({i}, {{{reads}}})")
            else:
                lines.append(f"    v{i} = {program.expression(i)}")
            lines.append(f"    if {i} in by_node: fill({i}, v{i})")
            dead = sorted(set(frees.get(i, ())) | ({i} if i not in last_read else set()))
            lines += [f"    del v{j}" for j in dead]
        lines.append("    return None")
        return "\n".join(lines) + "\n"


class RewrittenGraph:
    """The graph under one plan: call it with the graph's placeholder values, as the graph itself."""

    def __init__(self, schedule: _Schedule, unplanned: Callable[..., Any] | None = None) -> None:
        self.schedule = schedule
        self.unplanned = unplanned  # the graph's code, when the plan recomputes nothing

    @property
    def plan(self) -> Plan:
        return self.schedule.analysis.plan

    def __call__(self, *values: Any) -> Any:
        if self.unplanned is not None:
            return self.unplanned(*values)
        return _ForwardCall(self.schedule).run(list(values))


# ---------------------------------------------------------------------------------------------------------------
# Forward with saved-tensor handles


class SavedView(NamedTuple):
    """Where a saved tensor lies in its storage, and the storage's size: what a recompute must rebuild."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int


class _Saved:
    """What autograd stores for one saved tensor: the tensor itself, or a handle filled by recompute."""

    __slots__ = ("tensor", "version", "frame", "node", "leaf", "order", "view", "__weakref__")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.version = -1
        self.frame: _Frame | None = None
        self.node = -1
        self.leaf = -1
        self.order = -1
        self.view: SavedView | None = None

    def keep(self, t: torch.Tensor) -> _Saved:
        self.tensor = t.detach()
        self.version = t._version
        self.frame = None
        return self


def _unpack(saved: _Saved) -> torch.Tensor:
    if saved.frame is None:
        t = saved.tensor
        if t._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                f"(version {t._version}, saved at version {saved.version})")
        return t
    if saved.tensor is None:
        saved.frame.recompute()
    if saved.tensor is None:
        frame = saved.frame
        size, dtype = saved.view.size, saved.view.dtype
        what = f"its {saved.order + 1}. saved tensor" if saved.order >= 0 else f"output leaf {saved.leaf}"
        raise RecomputeError(
            f"sublinear: recomputing block {frame.block} did not rebuild {what} of "
            f"{frame.schedule.program.describe(saved.node)} (forward saved a {size} {dtype} tensor): the recompute "
            "took another path than forward. Were module attributes, flags or parameters changed between forward "
            "and backward?")
    t, saved.tensor = saved.tensor, None
    return t


class _Group:
    """Blocks of one forward call joined by soft split points: the retained inputs, RNG states and state snapshots
    that recomputing any of them needs."""

    def __init__(self) -> None:
        self.inputs: dict[int, Any] = {}
        self.rng: dict[int, tuple] = {}
        self.snapshots: dict[int, dict[Any, torch.Tensor]] = {}
        self.frames: list[_Frame] = []

    def close(self) -> None:
        """Keep only what the closures of the group's used frames read."""
        used = [f for f in self.frames if f.used]
        wanted = set().union(*(f.schedule.closure_inputs[f.block] for f in used))
        nodes = set().union(*(f.schedule.closure_nodes[f.block] for f in used))
        self.inputs = {j: v for j, v in self.inputs.items() if j in wanted}
        self.rng = {i: v for i, v in self.rng.items() if i in nodes}
        self.snapshots = {i: v for i, v in self.snapshots.items() if i in nodes}
        self.frames = []


class _Frame:
    """One block of one forward call: the handles it fills, rebuilt by the block's recompute closure."""

    def __init__(self, schedule: _Schedule, block: int, group: _Group) -> None:
        self.schedule = schedule
        self.block = block
        self.group = group
        group.frames.append(self)
        self.handles: list[weakref.ref] = []

    @property
    def used(self) -> bool:
        return any(r() is not None for r in self.handles)

    def recompute(self) -> None:
        s = self.schedule
        program = s.program
        handles = [h for h in (r() for r in self.handles) if h is not None]
        by_order = {(h.node, h.order): h for h in handles if h.order >= 0}
        by_node: dict[int, list[_Saved]] = {}
        for h in handles:
            if h.order < 0:
                by_node.setdefault(h.node, []).append(h)
        inputs = {j: _fresh_leaves(self.group.inputs[j]) for j in s.closure_inputs[self.block]}  # fresh leaves
        current = [-1, 0]

        def harvest(t: torch.Tensor) -> None:
            h = by_order.get((current[0], current[1]))
            current[1] += 1
            if h is not None:
                _check_same(h, t, program, current[0], self.block)
                h.tensor = t.detach()

        def never_unpacked(_: Any) -> torch.Tensor:
            raise AssertionError("sublinear: recompute graph is never differentiated")

        def fill(i: int, out: Any) -> None:
            for h in by_node[i]:
                h.tensor = _view_of(out, h.leaf, h.view, program, i, self.block)

        modes = _ModeSwitch()
        with modes, torch.autograd.graph.saved_tensors_hooks(harvest, never_unpacked):
            try:
                s.recompute[self.block](current, modes.enter, self._replay, fill, by_node, inputs)
            except RecomputeError:
                raise
            except Exception as exc:
                members = s.analysis.closure[self.block]
                names = ", ".join(s.op_names[o] for o in members[:3])
                raise RecomputeError(
                    f"sublinear: recomputing block {self.block} (ops {names}{', ...' if len(members) > 3 else ''}) "
                    f"failed at {program.describe(current[0])}: {type(exc).__name__}: {exc}") from exc

    def _replay(self, i: int, env: dict[int, Any]) -> Any:
        """Node ``i`` again under its forward RNG state, or on clones of the state it wrote as it was."""
        program = self.schedule.program
        snapshot = self.group.snapshots.get(i)
        if snapshot is not None:
            args, kwargs = program.arguments(i, env)
            args = list(args)
            for slot, t in snapshot.items():
                if isinstance(slot, int):
                    args[slot] = t.clone()
                else:
                    kwargs[slot] = t.clone()
            return program.call(i, tuple(args), kwargs)
        rng = self.group.rng.get(i)
        if rng is not None:
            cpu_state, cuda_states = rng
            with torch.random.fork_rng(devices=list(cuda_states), device_type="cuda"):
                torch.set_rng_state(cpu_state)
                for device, state in cuda_states.items():
                    torch.cuda.set_rng_state(state, device)
                return program.run_node(i, env)
        return program.run_node(i, env)


class _ModeSwitch:
    """Grad mode and autocast state for a run of replayed nodes, switched only where consecutive nodes differ."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.current: tuple | None = None

    def enter(self, mode: tuple) -> None:
        """Run under ``mode``: (grad enabled, autocast state)."""
        if mode == self.current:
            return
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(torch.set_grad_enabled(mode[0]))
        self.stack.enter_context(autocast_context(mode[1]))
        self.current = mode

    def __enter__(self) -> _ModeSwitch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def _fresh_leaves(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if isinstance(value, nn.Parameter):
            return value
        d = value.detach()
        return d.requires_grad_(True) if value.requires_grad else d
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh_leaves(v) for v in value)
    return value


def _tensor_leaves(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` in order (a list or tuple of tensors without flattening: the common case)."""
    if isinstance(values, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in values):
        return list(values)
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _check_same(saved: _Saved, t: torch.Tensor, program: NodeProgram, node: int, block: int) -> None:
    size, dtype = saved.view.size, saved.view.dtype
    if tuple(t.shape) != size or t.dtype != dtype:
        raise RecomputeError(
            f"sublinear: recomputing block {block} at {program.describe(node)}: its {saved.order + 1}. saved tensor "
            f"is a {tuple(t.shape)} {t.dtype} tensor, but forward saved a {size} {dtype} one. Were parameters, flags "
            "or the module changed between forward and backward?")


def _view_of(value: Any, leaf: int, view: SavedView, program: NodeProgram, node: int, block: int) -> torch.Tensor:
    tensors = _tensor_leaves([value])
    size, stride, offset, dtype, nbytes = view
    if leaf >= len(tensors) or tensors[leaf].untyped_storage().nbytes() != nbytes or tensors[leaf].dtype != dtype:
        got = "no tensor" if leaf >= len(tensors) else (
            f"a {tuple(tensors[leaf].shape)} {tensors[leaf].dtype} tensor on "
            f"{tensors[leaf].untyped_storage().nbytes()} bytes")
        raise RecomputeError(
            f"sublinear: recomputing block {block} at {program.describe(node)}: output leaf {leaf} is {got}, but "
            f"forward saved a {size} {dtype} view of a {nbytes}-byte storage. Were parameters, flags or the module "
            "changed between forward and backward?")
    base = tensors[leaf]
    with torch.no_grad():
        return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


class _ForwardCall:
    """State of one training forward: value ownership, retained storages, open frames."""

    def __init__(self, schedule: _Schedule) -> None:
        self.schedule = schedule
        self.owner: dict[int, tuple[int, int, weakref.ref]] = {}  # storage key -> (node, leaf, storage ref)
        self.retained: set[int] = set()
        self.frames: dict[int, _Frame] = {}
        self.groups: dict[int, _Group] = {}
        self.node = -1
        self.packs = 0  # tensors saved so far by the running node
        self.pending: list[tuple[_Saved, torch.Tensor, int]] = []

    def _own(self, tensors: Iterable[Any], node: int) -> None:
        """Register the storages of a node's output (node -1: inputs and constants) and whether they are retained."""
        known_leaves = self.schedule.leaf_retained.get(node, ())
        for leaf, t in enumerate(_tensor_leaves(tensors)):
            if storage_key(t) is None:
                continue  # a batched value inside a vmap region: its op is never split, it is never a handle
            st = t.untyped_storage()
            key = st._cdata
            entry = self.owner.get(key)
            if entry is None or entry[2]() is not st:
                self.owner[key] = (node, leaf, weakref.ref(st))
                self.retained.discard(key)  # the address may have belonged to a storage that is gone
            known = known_leaves[leaf] if leaf < len(known_leaves) else None
            if node < 0 or (known if known is not None else self.schedule.node_retained[node]):
                self.retained.add(key)

    def run(self, values: list[Any]) -> Any:
        self._own(values, -1)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            return self.schedule.forward(self, values)

    def _end_block(self, i: int) -> None:
        s = self.schedule
        del self.frames[s.block_of_node[i]]
        if i in s.group_end:
            self.groups.pop(s.group_of_node[i]).close()

    def _frame_for(self, i: int) -> _Frame:
        """The frame of node ``i``'s block (a node of a framed block), opened at the block's first node."""
        s = self.schedule
        b = s.block_of_node[i]
        frame = self.frames.get(b)
        if frame is None:
            group = self.groups.get(s.group_of_node[i])
            if group is None:
                group = self.groups[s.group_of_node[i]] = _Group()
            frame = self.frames[b] = _Frame(s, b, group)
        return frame

    def _prepare(self, frame: _Frame, i: int, env: dict[int, Any]) -> None:
        """Record what replaying node i in backward needs: inputs, RNG state, state before its writes."""
        s = self.schedule
        program = s.program
        for j in s.frame_inputs.get(i, ()):
            if j not in frame.group.inputs:
                frame.group.inputs[j] = _fresh_leaves(env[j])  # data and requires_grad: no autograd history
        facts = s.facts.get(i)
        if facts is None:
            return
        if facts.random:
            devices = sorted({t.device.index or 0 for t in tree_leaves([env[j] for j in program.inputs[i]])
                              if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
            if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
                devices = [torch.cuda.current_device()]
            frame.group.rng[i] = (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})
        if facts.state_args:
            args, kwargs = program.arguments(i, env)
            frame.group.snapshots[i] = {slot: (args[slot] if isinstance(slot, int) else kwargs[slot]).detach().clone()
                                        for slot in facts.state_args}

    def pack(self, t: torch.Tensor) -> _Saved:
        saved = _Saved()
        i = self.node
        if i < 0 or self.schedule.stores_all[i]:  # the forward names the running node only in framed blocks
            return saved.keep(t)
        order, self.packs = self.packs, self.packs + 1
        self.pending.append((saved, t, order))  # decided when the node returns and its outputs are known
        return saved

    def _handle(self, saved: _Saved, t: torch.Tensor, frame: _Frame, node: int, leaf: int = -1,
                order: int = -1) -> None:
        """Make ``saved`` a handle that ``frame``'s recompute fills, when the plan rebuilds ``node``'s op there;
        otherwise store the tensor (more memory than planned, never a wrong gradient)."""
        s = self.schedule
        if node < 0 or s.op_of_node[node] not in s.closure_ops[frame.block]:
            if node >= 0:
                _warn_unplanned(s, frame.block, node)
            saved.keep(t)
            return
        saved.frame, saved.node, saved.leaf, saved.order = frame, node, leaf, order
        saved.view = SavedView(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                               t.untyped_storage().nbytes())
        frame.handles.append(weakref.ref(saved))

    def _settle(self, i: int, frame: _Frame) -> None:
        """Decide what node ``i``'s saved tensors become, now that its outputs have owners: stored, or handles."""
        s = self.schedule
        pending, self.pending = self.pending, []
        for saved, t, order in pending:
            if storage_key(t) is None:
                saved.keep(t)
                continue
            st = t.untyped_storage()
            entry = self.owner.get(st._cdata)
            owned = entry is not None and entry[2]() is st
            if (owned and st._cdata in self.retained) or (not owned and not s.recomputable[i]):
                saved.keep(t)
            elif owned:
                self._handle(saved, t, frame, entry[0], leaf=entry[1])
            else:
                self._handle(saved, t, frame, i, order=order)


_warned: set[tuple[int, int]] = set()


def _warn_unplanned(schedule: _Schedule, block: int, node: int) -> None:
    key = (id(schedule), node)
    if key not in _warned:
        _warned.add(key)
        log.warning("sublinear: %s saved a tensor in block %d that the plan does not rebuild there; it is "
                    "stored instead (correct gradients, more memory than predicted). The profiled step and this call "
                    "differ.", schedule.program.describe(node), block)
