"""The profile of one training step: plain numbers per op, per storage and per backward node (no torch objects).

Units of planning are *ops*: contiguous runs of operator nodes that stay in one block because a node writes in
place a storage that an earlier node of the run produced (``ReLU(inplace=True)``, ``out += x``). Across op
boundaries a storage is therefore never written again once produced. Memory is counted per storage, so views and
in-place results alias their base, and a storage that autograd saves and that is also kept for another reason is
one storage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from sublinear.core.units import format_bytes

__all__ = ["AutocastState", "GraphProfile", "NodeFacts", "OpProfile", "ProfileArrays", "ShardedParameters",
           "StepContext", "costs_of", "profile_summary", "with_costs"]

AutocastState = tuple[tuple[str, bool, str], ...]  # per device type: (device, enabled, dtype name)


@dataclass(frozen=True)
class NodeFacts:
    """What the rewriter must know about one operator node to recompute it exactly.

    ``grad_enabled`` and ``autocast`` are the modes the node ran under in forward (a graph may switch them, as
    ``torch.no_grad()`` or ``torch.autocast(enabled=False)`` inside a forward do); a recompute replays the node
    under the same modes.
    """

    random: bool = False
    state_args: tuple[int | str, ...] = ()  # positions/names of tensor args whose state it writes (snapshot, redirect)
    pin_reason: str = ""  # non-empty: the node must never be recomputed
    grad_enabled: bool = True
    autocast: AutocastState = ()


@dataclass(frozen=True)
class OpProfile:
    """One planning unit: node positions ``nodes`` (contiguous operators of the graph)."""

    index: int
    nodes: tuple[int, ...]
    name: str  # module path and node name, for people
    flops: int
    forward_extra_bytes: int  # most bytes the op's own allocations (and kernel workspace) hold at once while it runs
    snapshot_bytes: int  # state it writes, cloned in forward when the op may be recomputed
    random: bool
    mutates_state: bool
    pin_reason: str
    forward_seconds: float = 0.0  # device time of the op's forward (measured, or estimated from FLOPs and bytes)
    # Device time of re-running the op in backward, where it differs from its forward: a compiled recompute is fused
    # into the backward kernels that read it (no launch, no write of a value that is no buffer there). None: as
    # forward.
    rerun_seconds: float | None = None
    # Bytes the op's own allocations hold while backward re-runs it, where they differ from its forward's: a value
    # that is a buffer only because a random op that is never re-run reads it (aten's dropout, called as a library
    # kernel under inductor's fallback_random) is fused into its readers there. None: as forward.
    rerun_extra_bytes: int | None = None
    # Bytes a compile check found the compiled forward holding at the op beyond the simulation: counted at its
    # forward only (a re-run in backward is compiled into other kernels, and taught at the rank it runs at).
    forward_lesson_bytes: int = 0

    @property
    def pinned(self) -> bool:
        return bool(self.pin_reason)


@dataclass(frozen=True)
class ShardedParameters:
    """One process's parameter and gradient bytes under FSDP2 (shards are padded to equal size, as FSDP stores them).

    Per process, a step holds the parameter shards, always; the all-gathered (unsharded) parameters from the forward's
    start until FSDP reshards them after backward; the all-gather output buffer through the forward; and, after
    backward, the reduce-scatter input and output buffers that turn the full gradients into gradient shards. Gloo,
    which lacks native reduce-scatter and in-place all-gather, also copies each collective's full buffer.
    """

    world_size: int
    sharded_bytes: int  # the process's parameter shards, held across steps
    unsharded_bytes: int  # the all-gathered parameters (padded), held from forward until reshard after backward
    reduce_scatter_bytes: int  # the reduce-scatter input: every process's padded gradients, in the reduce dtype
    sharded_gradient_bytes: int  # the process's gradient shards the step leaves behind
    collective_workspace: bool  # the backend copies a collective's full buffer while it runs (gloo)
    reshard_after_forward: bool  # parameters freed after forward and gathered again for backward

    @property
    def all_gather_bytes(self) -> int:
        """The all-gather output buffer, held through the forward: every process's shard at the gathered dtype."""
        return self.unsharded_bytes

    def workspace(self, buffer_bytes: int) -> int:
        """The backend's copy of a collective's buffer while the collective runs."""
        return buffer_bytes if self.collective_workspace else 0

    def backward_gather_bytes(self) -> int:
        """Bytes beside the shards while FSDP gathers the parameters again for backward (resharded after
        forward): the all-gather buffer and the larger of the gathered parameters and the backend's copy."""
        return self.all_gather_bytes + max(self.unsharded_bytes, self.workspace(self.all_gather_bytes))

    def __str__(self) -> str:
        return (f"FSDP over {self.world_size} ranks: parameter shards {format_bytes(self.sharded_bytes)}, "
                f"gathered {format_bytes(self.unsharded_bytes)}")


@dataclass(frozen=True)
class StepContext:
    """Memory the other graphs of one training call keep live beside this graph.

    TorchDynamo splits a call at graph breaks into graphs that run forward in order and backward in reverse order,
    so while graph i runs, every earlier graph holds what it kept after its forward, and every parameter and buffer
    of the model is live. Byte counts exclude what this graph's own profile counts (its parameters, buffers and
    inputs, even when an earlier graph produced them).

    beside_forward: live beside this graph's forward.
    beside_backward: live beside its backward: ``beside_forward`` plus the gradients later graphs' backward made.
    later_beyond_held: the highest step peak of the later graphs, less what this graph holds after its forward
        (they run beside it, so this graph's plan raises their peak by exactly what it holds); None when no graph
        runs after this one.
    floor_bytes: what the call holds at some point whatever any graph's plan: its parameters, buffers and inputs
        with the gradients of its parameters when the step ends, and the eager code's backward beside what the code
        before it holds: no plan of any graph takes the step below it.
    """

    beside_forward: int = 0
    beside_backward: int = 0
    later_beyond_held: int | None = None
    floor_bytes: int = 0

    def __str__(self) -> str:
        later = "" if self.later_beyond_held is None else \
            f", later graphs need {format_bytes(self.later_beyond_held)} beyond what it holds"
        return (f"other graphs of the call: {format_bytes(self.beside_forward)} beside forward, "
                f"{format_bytes(self.beside_backward)} beside backward{later}")


def _empty(dtype=np.int64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


def _columns(rows: list[tuple[int, ...]], width: int = 2) -> tuple[np.ndarray, ...]:
    """Rows of ``width`` integers as one int64 array per column (empty rows: empty columns)."""
    array = np.asarray(rows, dtype=np.int64).reshape(-1, width)
    return tuple(array[:, k].copy() for k in range(width))


@dataclass
class GraphProfile:
    """The planner's view of one training step of one captured graph.

    Storages are indexed 0..S-1. ``storage_last_use[s]`` is the last op that reads a value on ``s`` in forward
    (``len(ops)`` for graph outputs); ``storage_saved_by[s]`` lists the ops whose autograd saves it; storages that
    neither outlive their op nor are saved are folded into ``forward_extra_bytes``. ``op_inputs[o]`` lists, per
    value op ``o`` reads from another op, ``(producer op, storages of the value)``.

    Backward runs node by node: operator nodes (*ranks*, in graph order) with their op (``node_op``), the ranks
    whose autograd saves each storage (``storage_saved_at``), and per rank the gradient-side bytes as its backward
    starts, at its peak before and after it frees what it saved (plan-independent, with workspaces), and its time."""

    ops: list[OpProfile]
    storage_bytes: np.ndarray
    storage_producer: np.ndarray
    storage_last_use: np.ndarray
    storage_saved_by: list[tuple[int, ...]]
    op_inputs: list[tuple[tuple[int, tuple[int, ...]], ...]]
    baseline_bytes: int  # parameters, buffers, inputs and library workspaces: live before the step starts
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    measured_peak_bytes: int  # the profiled eager step's peak (storage tracking)
    backward_flops: int
    workspace_bytes: int = 0  # library workspaces held beside the step's tensors (CUDA: cuBLAS's), in the baseline
    node_facts: dict[int, NodeFacts] = field(default_factory=dict)
    op_of_node: dict[int, int] = field(default_factory=dict)
    node_storages: dict[int, tuple[int, ...]] = field(default_factory=dict)  # node -> storage per tensor (-1: none)
    reaches_output: np.ndarray = field(default_factory=lambda: _empty(bool))  # per op
    op_storages: list[tuple[int, ...]] = field(default_factory=list)  # per op: storages of the values it outputs
    held_through_forward: np.ndarray = field(default_factory=lambda: _empty(bool))  # autocast cache, dropped outputs
    output_storages: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # per tensor output (-1: untracked)
    saved_inputs: np.ndarray = field(default_factory=lambda: _empty(bool))  # per graph input (empty: unknown, saved)
    storage_saved_at: list[tuple[int, ...]] = field(default_factory=list)
    node_op: np.ndarray = field(default_factory=_empty)
    grad_start: np.ndarray = field(default_factory=_empty)
    grad_peak: np.ndarray = field(default_factory=_empty)
    grad_after_release: np.ndarray = field(default_factory=_empty)
    grad_peak_freed: np.ndarray = field(default_factory=_empty)  # per rank: its peak's fall where forward values it
    # reads early are let go early (a compiled step; empty: none), counted where the plan keeps all it reads
    # Per op: its first backward reader's rank and the gradient-side bytes there, where it is re-run (empty: none)
    rerun_grad_side: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    backward_seconds: np.ndarray = field(default_factory=lambda: _empty(float))  # per rank
    cost_source: str = "none"  # how op times were obtained: "measured on <device>" or "estimated: <rates>"
    sharding: ShardedParameters | None = None  # FSDP2's per-rank layout; None: full parameters and gradients
    step_context: StepContext | None = None  # the other graphs of the call; None: this graph is the whole step
    output_uses: tuple[str, ...] = ()  # per tensor output: "gradient", "held" (to the step's end) or "dropped"
    # Per storage, for a compiled step (empty: memory whenever live): whether it takes memory while only forward
    # readers hold it (none where its producer is fused into them), and whether a recompute's copy of it does.
    materialized_in_forward: np.ndarray = field(default_factory=lambda: _empty(bool))
    materialized_when_rebuilt: np.ndarray = field(default_factory=lambda: _empty(bool))
    # Per storage, compiled: a buffer in forward only because forward saves it for backward (a fused value), counted
    # in its op's forward bytes and from ``storage_fused_from`` (the earlier op whose kernel makes it, -1: its own;
    # empty: none anywhere) in every op's up to its own; a plan that does not retain it makes no buffer for it.
    saved_buffer: np.ndarray = field(default_factory=lambda: _empty(bool))
    storage_fused_from: np.ndarray = field(default_factory=_empty)
    # Per storage, compiled (-1 or empty: none): the rank whose backward kernel, its last reader, writes its output
    # into its buffer (the storage ends as that backward starts); the storage whose buffer its re-run may take.
    storage_taken_at: np.ndarray = field(default_factory=_empty)
    storage_rerun_into: np.ndarray = field(default_factory=_empty)
    # Per storage, for a compiled step (empty: none known): the ranks whose backward kernels compute a fused value
    # from its re-run copy, the storages the nodes computing it read, and the highest rank by whose backward a node
    # reading it must have run (-1: none, or only a weight's gradient, which waits for the end).
    storage_rebuilt_read_at: list[tuple[int, ...]] = field(default_factory=list)
    storage_made_from: list[tuple[int, ...]] = field(default_factory=list)
    storage_deadline: np.ndarray = field(default_factory=_empty)
    # Per storage, for a compiled step (empty: none known): the first (highest) rank of a fused backward kernel
    # that reads it below that rank, or that runs just before a library kernel reading it (-1: none), and whether a
    # library kernel makes it. The kernel allocates all its buffers before it runs, a value it re-runs among them.
    # ``storage_kernel_late``: that kernel runs after that rank's backward let go of what it read last (empty: none).
    storage_kernel_start: np.ndarray = field(default_factory=_empty)
    storage_kernel_late: np.ndarray = field(default_factory=lambda: _empty(bool))
    storage_library_made: np.ndarray = field(default_factory=lambda: _empty(bool))
    # Per rank, compiled (empty: none known): the rank its first backward node's fused kernel runs at (-1: none).
    kernel_of_rank: np.ndarray = field(default_factory=_empty)
    # Per storage (empty: none anywhere; -1: none): its last backward reader's rank, a pointwise op reading it, and
    # the rank that op's re-run is made for; where the plan re-runs it so, the reader runs in that re-run's kernel.
    storage_read_in_rerun: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    # A compiled backward runs each recomputed op once, in the block whose recompute comes first, and keeps its
    # values until every block that reads them is done (False: every block's recompute rebuilds its own copies).
    recompute_shared: bool = False

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @functools.cached_property
    def arrays(self) -> ProfileArrays:
        """The profile's lists as flat index arrays (:class:`ProfileArrays`)."""
        return ProfileArrays(self)

    @property
    def held_output_bytes(self) -> int:
        """Bytes of the outputs the caller holds to the step's end: the most a plan's peak falls by without them."""
        held = {int(s) for s, use in zip(self.output_storages, self.output_uses) if use == "held" and s >= 0}
        return int(sum(int(self.storage_bytes[s]) for s in held))

    @functools.cached_property
    def pinned_ops(self) -> np.ndarray:
        return np.array([op.index for op in self.ops if op.pinned], dtype=np.int64)

    @functools.cached_property
    def forward_extra(self) -> np.ndarray:
        """Per op: ``forward_extra_bytes``."""
        return np.array([op.forward_extra_bytes for op in self.ops], dtype=np.int64)

    @functools.cached_property
    def rerun_extra(self) -> np.ndarray:
        """Per op: ``rerun_extra_bytes``, else ``forward_extra_bytes``."""
        return np.array([op.forward_extra_bytes if op.rerun_extra_bytes is None else op.rerun_extra_bytes
                         for op in self.ops], dtype=np.int64)

    @functools.cached_property
    def forward_lesson(self) -> np.ndarray:
        """Per op: ``forward_lesson_bytes``."""
        return np.array([op.forward_lesson_bytes for op in self.ops], dtype=np.int64)

    @property
    def output_gradient_bytes(self) -> int:
        """The gradients handed to the outputs, live before the first backward node runs (FSDP's hook on them
        gathers the parameters again)."""
        return int(self.grad_start[-1]) if len(self.grad_start) else 0

    @functools.cached_property
    def op_flops(self) -> np.ndarray:
        return np.array([op.flops for op in self.ops], dtype=np.int64)

    @functools.cached_property
    def op_seconds(self) -> np.ndarray:
        """Per op: what re-running it in backward costs (``rerun_seconds``, else ``forward_seconds``)."""
        return np.array([op.forward_seconds if op.rerun_seconds is None else op.rerun_seconds for op in self.ops],
                        dtype=np.float64)

    @property
    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def step_flops(self) -> int:  # one eager training step's, forward and backward
        return self.forward_flops + self.backward_flops

    @property
    def forward_seconds(self) -> float:
        return float(sum(op.forward_seconds for op in self.ops))

    @functools.cached_property
    def step_seconds(self) -> float:
        """Predicted time of one eager training step (forward and backward)."""
        return self.forward_seconds + float(np.sum(self.backward_seconds))

def profile_summary(profile: GraphProfile, top: int = 5) -> str:
    """The profile's sizes and time in one line, then its ``top`` largest storages and the ops that make them."""
    p = profile
    lines = [f"{p.num_ops} ops, forward {p.forward_flops / 1e9:.2f} GFLOP, eager step peak "
             f"{format_bytes(p.measured_peak_bytes)} (parameters {format_bytes(p.parameter_bytes)}, "
             f"buffers {format_bytes(p.buffer_bytes)}, inputs {format_bytes(p.input_bytes)}, "
             f"gradients {format_bytes(p.gradient_bytes)}); step time {p.step_seconds * 1e3:.1f} ms "
             f"({p.cost_source})"]
    for s in np.argsort(-p.storage_bytes)[:top]:
        lines.append(f"  {format_bytes(p.storage_bytes[s]):>10s}  from {p.ops[p.storage_producer[s]].name}")
    return "\n".join(lines)


class ProfileArrays:
    """A profile's per-storage and per-op lists as flat index arrays, and the ops' release slots; built once per
    profile (:attr:`GraphProfile.arrays`) for the simulator and the plan analysis."""

    def __init__(self, profile: GraphProfile) -> None:
        self.profile = profile

    @functools.cached_property
    def snapshots(self) -> tuple[np.ndarray, np.ndarray]:
        """(op, bytes) for every op that snapshots state it writes."""
        return _columns([(op.index, op.snapshot_bytes) for op in self.profile.ops if op.snapshot_bytes])

    def rerun_grad_side(self, ops: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The gradient-side bytes beside each op re-run for a rank: as its first backward reader's kernel starts
        where that reader is at the rank (``rerun_grad_side``), else as the rank's backward starts."""
        p, side = self.profile, self.profile.grad_start[ranks]
        if len(p.rerun_grad_side) and len(ops):
            side = np.where(p.rerun_grad_side[ops, 0] == ranks, p.rerun_grad_side[ops, 1], side)
        return side

    @functools.cached_property
    def most_rerun_grad_side(self) -> np.ndarray:
        """Per rank: the most gradient-side bytes beside an op re-run for it (:meth:`rerun_grad_side`)."""
        p = self.profile
        most = p.grad_start.copy()
        if len(p.rerun_grad_side):
            read = p.rerun_grad_side[:, 0] >= 0
            np.maximum.at(most, p.rerun_grad_side[read, 0], p.rerun_grad_side[read, 1])
        return most

    @functools.cached_property
    def saved_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(storage, rank) for every operator node that saves a storage: ``storage_saved_at`` as two arrays."""
        pairs = [(s, r) for s, ranks in enumerate(self.profile.storage_saved_at) for r in ranks]
        return _columns(pairs)

    @functools.cached_property
    def rebuilt_read_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(storage, rank) for every backward read of a re-run copy beyond the saves: ``storage_rebuilt_read_at``."""
        return _columns([(s, r) for s, ranks in enumerate(self.profile.storage_rebuilt_read_at) for r in ranks])

    @functools.cached_property
    def read_through_only(self) -> np.ndarray:
        """Per storage: tracked only because backward kernels read its re-run copy through fused values (no later
        op reads it, no backward node saves it, the graph does not return it)."""
        p = self.profile
        through = np.array([bool(ranks) for ranks in p.storage_rebuilt_read_at], dtype=bool)
        if not len(through):
            return np.zeros(len(p.storage_bytes), dtype=bool)
        unsaved = np.array([not ranks for ranks in p.storage_saved_at], dtype=bool)
        return through & unsaved & (p.storage_last_use == p.storage_producer)

    @functools.cached_property
    def made_from_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(storage, storage it is made from) for every pair of ``storage_made_from``, made storages descending."""
        rows = [(s, m) for s in range(len(self.profile.storage_made_from) - 1, -1, -1)
                for m in self.profile.storage_made_from[s]]
        return _columns(rows)

    @functools.cached_property
    def output_bytes(self) -> np.ndarray:
        """Per op: bytes of the storages it produces."""
        produced = np.zeros(self.profile.num_ops, dtype=np.int64)
        np.add.at(produced, self.profile.storage_producer, self.profile.storage_bytes)
        return produced

    @functools.cached_property
    def rebuild_bytes(self) -> np.ndarray:
        """Per op: bytes of the storages it produces that autograd saves, what recomputing it rebuilds (Chen's
        measure)."""
        saved = np.array([bool(ops) for ops in self.profile.storage_saved_by], dtype=bool)
        produced = np.zeros(self.profile.num_ops, dtype=np.int64)
        np.add.at(produced, self.profile.storage_producer, self.profile.storage_bytes * saved)
        return produced

    @functools.cached_property
    def recompute_density(self) -> np.ndarray:
        """Per op: recompute seconds per byte it outputs (at least one): what recomputing it costs for the memory
        that not keeping it frees."""
        return self.profile.op_seconds / np.maximum(1, self.output_bytes)

    @functools.cached_property
    def input_triples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(storage, reader op, producer op) for every storage of every value an op reads from another op:
        ``op_inputs`` as three arrays, ordered by reader."""
        return _columns([(s, o, p) for o, inputs in enumerate(self.profile.op_inputs) for p, storages in inputs
                         for s in storages], width=3)

    @functools.cached_property
    def read_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(storage, op) for every value an op reads from another op: ``op_inputs`` as two arrays."""
        storages, readers, _ = self.input_triples
        return storages, readers

    @functools.cached_property
    def input_bounds(self) -> np.ndarray:
        """Per op ``o``: its entries of :attr:`input_triples` are ``input_bounds[o]:input_bounds[o + 1]``."""
        return np.searchsorted(self.input_triples[1], np.arange(self.profile.num_ops + 1))

    @functools.cached_property
    def inputs_by_reader(self) -> list[list[tuple[int, int]]]:
        """Per op: ``(producer op, storage)`` for every storage of every value it reads from another op."""
        return [[(p, s) for p, storages in inputs for s in storages] for inputs in self.profile.op_inputs]

    @functools.cached_property
    def tuple_of(self) -> np.ndarray:
        """Per storage: the index of the node whose value holds several tensors (a tuple, as ``var_mean`` or a
        max-pool with its indices) that makes it, -1 where a node of one tensor does."""
        made = np.full(len(self.profile.storage_producer), -1, dtype=np.int64)
        tuples = [storages for storages in self.profile.node_storages.values() if len(storages) > 1]
        for index, storages in enumerate(tuples):
            made[[s for s in storages if s >= 0]] = index
        return made

    @functools.cached_property
    def produced_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(storages sorted by producer, bounds): op ``o`` produces ``order[bounds[o]:bounds[o + 1]]``."""
        producer = self.profile.storage_producer
        order = np.argsort(producer, kind="stable")
        return order, np.searchsorted(producer[order], np.arange(self.profile.num_ops + 1))

    @functools.cached_property
    def op_storage_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(op, storage) for every storage of every value an op outputs: ``op_storages`` as two arrays."""
        return _columns([(o, s) for o, storages in enumerate(self.profile.op_storages) for s in storages])

    @functools.cached_property
    def saved_reaching(self) -> np.ndarray:
        """Per storage: an op whose values reach the outputs saves it for backward."""
        reaches = self.profile.reaches_output
        return np.array([any(reaches[o] for o in savers) for savers in self.profile.storage_saved_by], dtype=bool)

    @functools.cached_property
    def op_release(self) -> np.ndarray:
        """Per op: the last forward op whose run an autograd node of it may see if its values never reach the
        outputs (``num_ops``: the end of the step). A node lives while any tensor downstream of it does, so the
        release of an op is the latest of its own values' last use and the release of every op that reads them."""
        profile = self.profile
        n = profile.num_ops
        release = np.arange(n, dtype=np.int64)
        np.maximum.at(release, profile.storage_producer, np.minimum(profile.storage_last_use, n))
        consumers: list[list[int]] = [[] for _ in range(n)]
        for c, inputs in enumerate(profile.op_inputs):
            for p, _ in inputs:
                consumers[p].append(c)
        for o in range(n - 1, -1, -1):
            for c in consumers[o]:
                release[o] = max(release[o], release[c])
        return release


def costs_of(profile: GraphProfile) -> dict:
    """The device-dependent part of ``profile``, as JSON-ready lists (for the plan cache): op times, the bytes
    an op's forward and a rank's backward hold beside the storages (measured scratch, a compile check's
    lessons)."""
    return {"cost_source": profile.cost_source,
            "forward_seconds": [op.forward_seconds for op in profile.ops],
            "rerun_seconds": [op.rerun_seconds for op in profile.ops],
            "forward_extra_bytes": [op.forward_extra_bytes for op in profile.ops],
            "forward_lesson_bytes": [op.forward_lesson_bytes for op in profile.ops],
            "backward_seconds": [float(v) for v in profile.backward_seconds],
            "grad_peak": [int(v) for v in profile.grad_peak],
            "grad_after_release": [int(v) for v in profile.grad_after_release]}


def with_costs(profile: GraphProfile, costs: dict) -> GraphProfile:
    """``profile`` with the costs of :func:`costs_of` (taken earlier for the same graph and signature)."""
    if len(costs["forward_seconds"]) != profile.num_ops or len(costs["grad_peak"]) != len(profile.grad_peak):
        raise ValueError("costs belong to another graph")
    rerun = costs.get("rerun_seconds") or [op.rerun_seconds for op in profile.ops]
    lessons = costs.get("forward_lesson_bytes") or [0] * profile.num_ops
    ops = [replace(op, forward_seconds=float(t), rerun_seconds=r, forward_extra_bytes=int(b),
                   forward_lesson_bytes=int(f))
           for op, t, r, b, f in zip(profile.ops, costs["forward_seconds"], rerun, costs["forward_extra_bytes"],
                                     lessons)]
    return replace(profile, ops=ops, backward_seconds=np.asarray(costs["backward_seconds"], dtype=float),
                   grad_peak=np.asarray(costs["grad_peak"], dtype=np.int64),
                   grad_after_release=np.asarray(costs["grad_after_release"], dtype=np.int64),
                   cost_source=costs["cost_source"])
