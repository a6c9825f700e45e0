"""Rewrite: run a captured graph so that only retained values survive forward and each block is rebuilt in backward.

Mechanism (non-reentrant, so ``torch.autograd.grad``, DDP and retain_graph work): while an op of a recomputable
block runs, a saved-tensor hook stores every tensor autograd saves whose storage is retained (see
:mod:`sublinear.plan`), and replaces any other by a handle:

- a *view handle* names the node whose output owns the storage and the view's size/stride/offset;
- an *order handle* names a storage created inside a node that no value owns (BatchNorm's saved mean, dropout's
  mask): the k-th tensor that node saves.

The first unpack of a block's handle re-runs the block's recompute closure under ``enable_grad`` with the same
autocast state, the same RNG state for random nodes, and state writes redirected to clones of the state as it was
(BatchNorm running statistics are updated once, in forward). The rebuilt storages fill every handle of the block;
autograd frees each one after its node's backward, as in eager.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .tracer import CapturedGraph
from .interpret import NodeProgram
from .plan import Plan
from .profiler import GraphProfile, NodeFacts
from .simulator import analyse

__all__ = ["CheckpointedModule", "RecomputeError", "rewrite", "share_module_state"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


class RecomputeError(RuntimeError):
    """A node failed while its block was recomputed in backward."""


def rewrite(captured: CapturedGraph, profile: GraphProfile, plan: Plan) -> CheckpointedModule:
    """A module computing ``captured.module`` that recomputes per ``plan`` in training, sharing its tensors."""
    return CheckpointedModule(captured, _Schedule(captured, profile, plan))


class _Schedule:
    """Static, per-plan facts about every node, computed once."""

    def __init__(self, captured: CapturedGraph, profile: GraphProfile, plan: Plan) -> None:
        plan.validate(profile.num_ops)
        self.plan = plan
        program = NodeProgram(captured.graph_module, root=captured.module)
        self.program = program
        if len(program.operators) != sum(len(op.nodes) for op in profile.ops):
            raise ValueError("profile and graph disagree on the operators; profile the same captured graph")
        n_nodes = len(program.nodes)
        block_of_op = plan.block_of(profile.num_ops)
        group_of_block = self.group_of_block = plan.group_of_blocks()
        last_block = plan.num_blocks - 1
        self.op_of_node = [-1] * n_nodes
        self.block_of_node = [-1] * n_nodes
        self.group_of_node = [-1] * n_nodes
        for op in profile.ops:
            for i in op.nodes:
                self.op_of_node[i] = op.index
                self.block_of_node[i] = block_of_op[op.index]
                self.group_of_node[i] = group_of_block[block_of_op[op.index]]
        kept_ops = set(plan.kept) | {op.index for op in profile.ops if op.pinned}
        # recomputable[i]: node i belongs to an op that may be re-run in backward.
        self.recomputable = [self.op_of_node[i] >= 0 and self.block_of_node[i] != last_block
                             and self.op_of_node[i] not in kept_ops for i in range(n_nodes)]
        self.in_frame_block = [self.op_of_node[i] >= 0 and self.block_of_node[i] != last_block
                               for i in range(n_nodes)]
        self.block_end = {profile.ops[ops[-1]].nodes[-1] for ops in plan.blocks()}
        self.group_end = {profile.ops[ops[-1]].nodes[-1] for b, ops in enumerate(plan.blocks())
                          if b == last_block or group_of_block[b + 1] != group_of_block[b]}
        self.nodes_of_op = [op.nodes for op in profile.ops]
        self.op_names = [op.name for op in profile.ops]
        # Inputs of each op read from outside it: (node, producer op or -1 for state/inputs).
        self.op_inputs: list[list[tuple[int, int]]] = []
        for op in profile.ops:
            members = set(op.nodes)
            ins: dict[int, int] = {}
            for i in op.nodes:
                for j in program.inputs[i]:
                    if j not in members:
                        ins[j] = self.op_of_node[j]
            self.op_inputs.append(list(ins.items()))
        self.facts: dict[int, NodeFacts] = profile.node_facts
        # Ops whose values never reach the outputs: autograd frees what they save in forward; store it as is.
        self.stores_all = [self.op_of_node[i] < 0 or not profile.reaches_output[self.op_of_node[i]]
                           for i in range(n_nodes)]
        # Per tensor leaf of each node's output: is its storage retained under the plan (None: not profiled).
        retained_storage = analyse(profile, plan).retained
        self.leaf_retained: dict[int, tuple[bool | None, ...]] = {
            i: tuple(bool(retained_storage[sid]) if sid >= 0 else None for sid in sids)
            for i, sids in profile.node_storages.items()}
        # retained[i]: node i's value survives its group, so a recompute reads it from the frame instead of
        # re-running node i. Placeholders and get_attr (inputs, state) always; otherwise every storage of the value
        # is retained; for storages the profile did not see, the value is read by a later group or kept.
        self.retained = [True] * n_nodes
        for i in range(n_nodes):
            if self.op_of_node[i] < 0:
                continue
            static = self.leaf_retained.get(i)
            if static is not None and None not in static:  # also non-tensor values: () is all retained
                self.retained[i] = all(static)
            else:
                self.retained[i] = (not self.recomputable[i]) or any(
                    u == program.output or self.group_of_node[u] > self.group_of_node[i] for u in program.users[i])
        self.num_blocks = plan.num_blocks


def share_module_state(wrapper: nn.Module, original: nn.Module) -> None:
    """``wrapper`` holds ``original``'s own parameter, buffer and submodule dicts (so the same tensors, state_dict
    keys and optimizer targets) and follows its training flag; ``wrapper.original_module`` is ``original``."""
    wrapper._parameters = original._parameters
    wrapper._buffers = original._buffers
    wrapper._non_persistent_buffers_set = original._non_persistent_buffers_set
    wrapper._modules = original._modules
    wrapper.training = original.training
    object.__setattr__(wrapper, "original_module", original)


class CheckpointedModule(nn.Module):
    """The rewritten module.

    It shares the original module's parameter, buffer and submodule dictionaries, so ``state_dict()``,
    ``parameters()`` and optimizers see exactly the original's objects. In training with grad enabled it runs the
    captured graph under the plan; otherwise it calls the original module's forward unchanged.
    """

    def __init__(self, captured: CapturedGraph, schedule: _Schedule) -> None:
        super().__init__()
        share_module_state(self, captured.module)
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "_schedule", schedule)

    def train(self, mode: bool = True) -> CheckpointedModule:
        self.original_module.train(mode)
        return super().train(mode)

    def extra_repr(self) -> str:
        s = self._schedule
        return f"{type(self.original_module).__name__}, {s.num_blocks} blocks, captured by {self._captured.method}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
            return self.original_module(*args, **kwargs)
        values = self._captured.placeholder_values(args, kwargs)
        if not _any_requires_grad(values, self.original_module):
            return self.original_module(*args, **kwargs)
        return self._captured.outputs(_ForwardCall(self._schedule, self.original_module).run(values))


def _any_requires_grad(values: list[Any], module: nn.Module) -> bool:
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(values)):
        return True
    return any(p.requires_grad for p in module.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Forward with saved-tensor handles


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
        self.view: tuple | None = None

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
    t, saved.tensor = saved.tensor, None
    return t


class _Group:
    """Blocks of one forward call joined by soft split points: the retained inputs, RNG states and state snapshots
    that recomputing any of them needs."""

    def __init__(self, call: _ForwardCall) -> None:
        self.inputs: dict[int, Any] = {}
        self.rng: dict[int, tuple] = {}
        self.snapshots: dict[int, dict[Any, torch.Tensor]] = {}
        self.autocast = call.autocast
        self.frames: list[_Frame] = []

    def close(self) -> None:
        """Keep only what the closures of the group's used frames read."""
        used = [f for f in self.frames if f.closure]
        wanted = set().union(*(f.wanted for f in used))
        nodes = set().union(*(f.nodes for f in used))
        self.inputs = {j: v for j, v in self.inputs.items() if j in wanted}
        self.rng = {i: v for i, v in self.rng.items() if i in nodes}
        self.snapshots = {i: v for i, v in self.snapshots.items() if i in nodes}
        self.frames = []


class _Frame:
    """One block of one forward call: the handles it fills and the closure that rebuilds them."""

    def __init__(self, call: _ForwardCall, block: int, group: _Group) -> None:
        self.schedule = call.schedule
        self.block = block
        self.group = group
        group.frames.append(self)
        self.handles: list[weakref.ref] = []
        self.closure: list[int] = []
        self.nodes: set[int] = set()
        self.wanted: set[int] = set()

    def close(self) -> None:
        """Fix the recompute closure from the handles made: the ops producing them and, through values the group
        does not retain, their producers (possibly in earlier blocks of the group)."""
        s = self.schedule
        live = [h for h in (r() for r in self.handles) if h is not None]
        if not live:
            return
        needed = {s.op_of_node[h.node] for h in live}
        stack = list(needed)
        while stack:
            o = stack.pop()
            for j, p in s.op_inputs[o]:
                if p >= 0 and p not in needed and not s.retained[j]:
                    needed.add(p)
                    stack.append(p)
        self.closure = sorted(needed)
        self.nodes = {i for o in self.closure for i in s.nodes_of_op[o]}
        self.wanted = {j for o in self.closure for j, _ in s.op_inputs[o] if j not in self.nodes}

    def recompute(self) -> None:
        s = self.schedule
        program = s.program
        handles = [h for h in (r() for r in self.handles) if h is not None]
        by_order = {(h.node, h.order): h for h in handles if h.order >= 0}
        by_node: dict[int, list[_Saved]] = {}
        for h in handles:
            if h.order < 0:
                by_node.setdefault(h.node, []).append(h)
        env: dict[int, Any] = {j: _detached(self.group.inputs[j]) for j in self.wanted}  # fresh leaves per recompute
        current = [-1, 0]

        def harvest(t: torch.Tensor) -> None:
            h = by_order.get((current[0], current[1]))
            current[1] += 1
            if h is not None:
                _check_same(h, t, program.module_path(current[0]), self.block)
                h.tensor = t.detach()

        def never_unpacked(_: Any) -> torch.Tensor:
            raise AssertionError("sublinear: recompute graph is never differentiated")

        nodes = [i for o in self.closure for i in s.nodes_of_op[o]]
        last_read: dict[int, int] = {}
        for i in nodes:
            for j in program.inputs[i]:
                last_read[j] = i
        env_list: list[Any] = [None] * len(program.nodes)
        for j, v in env.items():
            env_list[j] = v
        with torch.enable_grad(), _autocast(self.group.autocast), \
                torch.autograd.graph.saved_tensors_hooks(harvest, never_unpacked):
            for i in nodes:
                current[0], current[1] = i, 0
                try:
                    out = self._replay(i, env_list)
                except Exception as exc:
                    names = ", ".join(s.op_names[o] for o in self.closure[:3])
                    raise RecomputeError(
                        f"sublinear: recomputing block {self.block} (ops {names}"
                        f"{', ...' if len(self.closure) > 3 else ''}) failed at "
                        f"{program.module_path(i)}: {type(exc).__name__}: {exc}") from exc
                env_list[i] = out
                for h in by_node.get(i, ()):
                    h.tensor = _view_of(out, h.leaf, h.view, program.module_path(i), self.block)
                for j in program.inputs[i]:
                    if last_read.get(j) == i:
                        env_list[j] = None
                if last_read.get(i) is None:
                    env_list[i] = None
                del out  # the next node must not run while this value is still referenced here

    def _replay(self, i: int, env: list[Any]) -> Any:
        s = self.schedule
        program = s.program
        facts = s.facts.get(i)
        snapshot = self.group.snapshots.get(i)
        if snapshot is not None:
            node = program.nodes[i]
            if facts.state_attrs:
                args = program._fetcher(node.args)(env)
                kwargs = program._fetcher(node.kwargs)(env) if node.kwargs else {}
                module = program._resolve(node.target)
                module = getattr(*module)
                fresh = {name: t.clone() for name, t in snapshot.items()}
                return torch.func.functional_call(module, fresh, args, kwargs, strict=False)
            return _call_with_args(program, i, env, {slot: t.clone() for slot, t in snapshot.items()})
        rng = self.group.rng.get(i)
        if rng is not None:
            cpu_state, cuda_states = rng
            with torch.random.fork_rng(devices=list(cuda_states), device_type="cuda"):
                torch.set_rng_state(cpu_state)
                for device, state in cuda_states.items():
                    torch.cuda.set_rng_state(state, device)
                return program.run_node(i, env)
        return program.run_node(i, env)


def _call_with_args(program: NodeProgram, i: int, env: list[Any], substitute: dict[Any, torch.Tensor]) -> Any:
    node = program.nodes[i]
    args = list(program._fetcher(node.args)(env))
    kwargs = dict(program._fetcher(node.kwargs)(env)) if node.kwargs else {}
    for slot, t in substitute.items():
        if isinstance(slot, int):
            args[slot] = t
        else:
            kwargs[slot] = t
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return getattr(*program._resolve(node.target))(*args, **kwargs)
    return node.target(*args, **kwargs)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if isinstance(value, nn.Parameter):
            return value
        d = value.detach()
        return d.requires_grad_(True) if value.requires_grad else d
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _check_same(saved: _Saved, t: torch.Tensor, where: str, block: int) -> None:
    size, stride, offset, dtype, _ = saved.view
    if tuple(t.shape) != size or t.dtype != dtype:
        raise RecomputeError(
            f"sublinear: recomputing block {block} at {where} gave a {tuple(t.shape)} {t.dtype} tensor that differs "
            f"from forward's {size} {dtype}; were parameters or the module changed between forward and backward?")


def _view_of(value: Any, leaf: int, view: tuple, where: str, block: int) -> torch.Tensor:
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    size, stride, offset, dtype, nbytes = view
    if leaf >= len(tensors) or tensors[leaf].untyped_storage().nbytes() != nbytes:
        raise RecomputeError(
            f"sublinear: recomputing block {block} at {where} gave a value that differs from forward's "
            f"(it no longer holds a {size} {dtype} view); were parameters or the module changed between forward "
            "and backward?")
    base = tensors[leaf]
    with torch.no_grad():
        return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


@contextlib.contextmanager
def _autocast(state: dict[str, tuple[bool, torch.dtype, bool]]):
    """Re-enter the autocast state of the forward pass, without its cast cache: the recompute's inputs are
    detached leaves, which the cache would keep (as if they were weights) until the outermost autocast exits."""
    with contextlib.ExitStack() as stack:
        for device_type, (enabled, dtype, _cache) in state.items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield


def _autocast_state() -> dict[str, tuple[bool, torch.dtype, bool]]:
    cache = torch.is_autocast_cache_enabled()
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), cache) for d in _AUTOCAST_DEVICES
            if d == "cpu" or torch.cuda.is_available()}


class _ForwardCall:
    """State of one training forward: value ownership, retained storages, open frames."""

    def __init__(self, schedule: _Schedule, root: nn.Module) -> None:
        self.schedule = schedule
        self.root = root
        self.autocast = _autocast_state()
        self.owner: dict[int, tuple[int, int, weakref.ref]] = {}  # storage key -> (node, leaf, storage ref)
        self.retained: set[int] = set()
        self.frames: dict[int, _Frame] = {}
        self.groups: dict[int, _Group] = {}
        self.node = -1
        self.packs = 0  # tensors saved so far by the running node
        self.pending: list[tuple[_Saved, torch.Tensor, int]] = []

    def _own(self, tensors: Iterable[Any], node: int) -> None:
        """Register the storages of a node's output (node -1: state and inputs) and whether they are retained."""
        static = self.schedule.leaf_retained.get(node, ())
        for leaf, t in enumerate(t for t in tree_leaves(list(tensors)) if isinstance(t, torch.Tensor)):
            st = t.untyped_storage()
            key = st._cdata
            entry = self.owner.get(key)
            if entry is None or entry[2]() is not st:
                self.owner[key] = (node, leaf, weakref.ref(st))
                self.retained.discard(key)  # the address may have belonged to a storage that is gone
            known = static[leaf] if leaf < len(static) else None
            if node < 0 or (known if known is not None else self.schedule.retained[node]):
                self.retained.add(key)

    def run(self, values: list[Any]) -> Any:
        s = self.schedule
        program = s.program
        self._own([*self.root.parameters(), *self.root.buffers(), *values], -1)
        env: list[Any] = [None] * len(program.nodes)
        for i, v in zip(program.placeholders, values):
            env[i] = v
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            for i, node in enumerate(program.nodes):
                if node.op == "placeholder":
                    continue
                if i == program.output:
                    return program.run_node(i, env)
                if node.op == "get_attr":
                    env[i] = program.run_node(i, env)
                    self._own([env[i]], -1)
                    continue
                frame = self._frame_for(i)
                if frame is not None and s.recomputable[i]:
                    self._prepare(frame, i, env)
                self.node, self.packs = i, 0
                try:
                    env[i] = program.run_node(i, env)
                finally:
                    self.node = -1
                self._after(i, env[i], frame)
                for j in program.frees_after[i]:
                    env[j] = None
                if frame is not None and i in s.block_end:
                    del self.frames[s.block_of_node[i]]
                    frame.close()
                    if i in s.group_end:
                        self.groups.pop(s.group_of_node[i]).close()
        raise AssertionError("graph has no output node")

    def _frame_for(self, i: int) -> _Frame | None:
        s = self.schedule
        if not s.in_frame_block[i]:
            return None
        b = s.block_of_node[i]
        frame = self.frames.get(b)
        if frame is None:
            group = self.groups.get(s.group_of_node[i])
            if group is None:
                group = self.groups[s.group_of_node[i]] = _Group(self)
            frame = self.frames[b] = _Frame(self, b, group)
        return frame

    def _prepare(self, frame: _Frame, i: int, env: list[Any]) -> None:
        """Record what replaying node i in backward needs: inputs, RNG state, state before its writes."""
        s = self.schedule
        program = s.program
        op = s.op_of_node[i]
        for j in program.inputs[i]:
            if s.op_of_node[j] != op and s.retained[j] and j not in frame.group.inputs:
                frame.group.inputs[j] = _detached(env[j])  # data and requires_grad only: no autograd history kept
        facts = s.facts.get(i)
        if facts is None:
            return
        if facts.random:
            devices = sorted({t.device.index or 0 for t in tree_leaves([env[j] for j in program.inputs[i]])
                              if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
            frame.group.rng[i] = (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})
        if facts.state_attrs:
            module = getattr(*program._resolve(program.nodes[i].target))
            state = dict(module.named_parameters()) | dict(module.named_buffers())
            frame.group.snapshots[i] = {name: state[name].detach().clone() for name in facts.state_attrs}
        elif facts.state_args:
            node = program.nodes[i]
            args = program._fetcher(node.args)(env)
            kwargs = program._fetcher(node.kwargs)(env) if node.kwargs else {}
            frame.group.snapshots[i] = {slot: (args[slot] if isinstance(slot, int) else kwargs[slot]).detach().clone()
                                  for slot in facts.state_args}

    def pack(self, t: torch.Tensor) -> _Saved:
        saved = _Saved()
        i = self.node
        if i < 0 or not self.schedule.in_frame_block[i] or self.schedule.stores_all[i]:
            return saved.keep(t)
        order, self.packs = self.packs, self.packs + 1
        self.pending.append((saved, t, order))  # decided when the node returns and its outputs are known
        return saved

    def _as_view_handle(self, saved: _Saved, node: int, leaf: int, t: torch.Tensor, frame: _Frame) -> None:
        """The saving node's block rebuilds the storage by re-running its producer ``node`` (same group)."""
        s = self.schedule
        if node < 0 or s.group_of_node[node] != s.group_of_block[frame.block]:  # produced outside the group
            saved.keep(t)
            return
        saved.frame, saved.node, saved.leaf = frame, node, leaf
        saved.view = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
        frame.handles.append(weakref.ref(saved))

    def _after(self, i: int, value: Any, frame: _Frame | None) -> None:
        s = self.schedule
        if frame is None:
            return
        self._own([value], i)
        pending, self.pending = self.pending, []
        for saved, t, order in pending:
            st = t.untyped_storage()
            entry = self.owner.get(st._cdata)
            owned = entry is not None and entry[2]() is st
            if (owned and st._cdata in self.retained) or (not owned and not s.recomputable[i]):
                saved.keep(t)
            elif owned:
                self._as_view_handle(saved, entry[0], entry[1], t, frame)
            else:
                saved.frame, saved.node, saved.order = frame, i, order
                saved.view = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                              t.untyped_storage().nbytes())
                frame.handles.append(weakref.ref(saved))
