"""One profiling stage, two front ends: what a front end learned about one training step (:class:`StepRecord`, its
storages named by the front end's own keys) and the one step that turns it into the planners' profile
(:func:`assemble`).

The eager front end (:mod:`.graph`) runs the step on fake tensors and tracks every storage; the compiled front end
(:mod:`.compiled`) reads the joint forward and backward graph inductor compiles. Both say the same things: the ops
and their nodes, per storage its size, producer, forward readers and the backward ranks that read it, per rank the
gradient side of backward, and per op and rank their times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile

__all__ = ["StepRecord", "assemble"]


@dataclass
class StepRecord:
    """A step as a front end read it. Storage keys are the front end's; ``tracked`` lists, in order, the storages
    that can outlive the op that produced them (a later op reads them, backward reads them, or the graph returns
    them); the others are inside their op (its ``forward_extra_bytes``).

    Per op: ``ops``, ``op_inputs`` (per value it reads from another op: the producer op and the value's storages)
    and ``reaches_output``. Per operator node: its op, facts and the storage of each tensor of its value
    (``node_keys``; storages that are not tracked, or state, are left out of the profile's ``node_storages``). Per
    storage: bytes, producer op, last forward reader (``num_ops`` for one held to the end of the step), the ops and
    ranks whose backward reads it. Per rank: its op and the gradient side of its backward.
    """

    ops: list[OpProfile]
    node_facts: dict[int, NodeFacts]
    op_of_node: dict[int, int]
    node_keys: dict[int, Sequence[int]]
    storage_bytes: dict[int, int]
    producer: dict[int, int]
    last_use: dict[int, int]
    saved_by: dict[int, set[int]]
    saved_at: dict[int, set[int]]
    op_inputs: list[list[tuple[int, Sequence[int]]]]
    tracked: list[int]
    reaches_output: Sequence[bool]
    node_op: Sequence[int]
    grad_start: Sequence[int]
    grad_peak: Sequence[int]
    grad_after: Sequence[int]
    backward_seconds: Sequence[float]
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    backward_flops: int
    cost_source: str
    output_uses: tuple[str, ...]
    measured_peak_bytes: int = 0
    workspace_bytes: int = 0  # library workspaces the step holds beside its tensors (blas_workspace_bytes)
    held_through_forward: set[int] = field(default_factory=set)
    output_storages: tuple[int, ...] = ()  # per tensor output, its storage's key (-1: not one forward made)
    saved_inputs: tuple[bool, ...] | None = None  # per graph input: autograd saves it (None: unknown, as if saved)
    materialized_in_forward: set[int] | None = None  # None: every storage takes memory whenever it is live
    materialized_when_rebuilt: set[int] | None = None
    taken_at: dict[int, int] = field(default_factory=dict)  # storage -> rank writing its output into it
    rerun_into: dict[int, int] = field(default_factory=dict)  # storage -> the buffer its re-run may be written into
    grad_peak_freed: Sequence[int] = ()  # per rank: its peak's fall where the plan keeps what it reads
    rebuilt_read_at: dict[int, set[int]] = field(default_factory=dict)  # storage -> ranks reading its re-run copy
    made_from: dict[int, set[int]] = field(default_factory=dict)  # storage -> the storages computing it reads
    deadline: dict[int, int] = field(default_factory=dict)  # storage -> rank by which backward must have read it
    saved_buffer: set[int] | None = None  # a buffer in forward only because forward saves it
    fused_from: dict[int, int] = field(default_factory=dict)  # storage -> the earlier op whose kernel makes it
    # storage -> the (first rank, starts before that rank's release) of the fused kernel that re-runs it
    kernel_start: dict[int, tuple[int, bool]] = field(default_factory=dict)
    library_made: set[int] | None = None  # storages a library kernel makes (None: unknown)
    kernel_of_rank: Sequence[int] = ()  # per rank: where the fused kernel of its first backward node runs (-1: none)
    # per op: (rank of its first backward reader, gradient-side bytes as that reader's kernel starts); empty: none
    rerun_grad_side: Sequence[tuple[int, int]] = ()
    # storage -> (rank of its last backward reader, an op reading it too, the rank that op's re-run is made for):
    # the reader runs in that re-run's kernel where the op re-runs for that rank
    read_in_rerun: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    recompute_shared: bool = False
    # Whether a kept op's view of another op's storage keeps that storage (the eager executor: the view is a tensor
    # autograd or the next op holds). A compiler that re-runs views from their rebuilt base (free, no kernel) does not:
    # an op's values are then only the storages it makes.
    views_hold_bases: bool = True


def assemble(record: StepRecord) -> GraphProfile:
    """The planners' profile of ``record``: storages indexed ``0..S-1`` in ``record.tracked``'s order."""
    tracked = record.tracked
    sid = {key: s for s, key in enumerate(tracked)}
    n_ops = len(record.ops)

    def flags(keys: set[int] | None) -> np.ndarray:
        if keys is None:
            return np.zeros(0, dtype=bool)
        return np.array([k in keys for k in tracked], dtype=bool)

    def ranks(table: dict[int, set[int]]) -> list[tuple[int, ...]]:
        return [tuple(sorted(table.get(k, ()))) for k in tracked]

    return GraphProfile(
        ops=record.ops,
        storage_bytes=np.array([record.storage_bytes[k] for k in tracked], dtype=np.int64),
        storage_producer=np.array([record.producer[k] for k in tracked], dtype=np.int64),
        storage_last_use=np.array([max(record.last_use.get(k, -1), record.producer[k]) for k in tracked],
                                  dtype=np.int64),
        storage_saved_by=ranks(record.saved_by),
        op_inputs=[tuple((p, tuple(sid[k] for k in keys if k in sid)) for p, keys in inputs)
                   for inputs in record.op_inputs],
        baseline_bytes=record.parameter_bytes + record.buffer_bytes + record.input_bytes + record.workspace_bytes,
        workspace_bytes=record.workspace_bytes,
        parameter_bytes=record.parameter_bytes,
        buffer_bytes=record.buffer_bytes,
        input_bytes=record.input_bytes,
        gradient_bytes=record.gradient_bytes,
        measured_peak_bytes=record.measured_peak_bytes,
        backward_flops=record.backward_flops,
        node_facts=record.node_facts,
        op_of_node=record.op_of_node,
        node_storages={i: tuple(sid.get(k, -1) for k in keys) for i, keys in record.node_keys.items()},
        reaches_output=np.asarray(record.reaches_output, dtype=bool),
        op_storages=_op_storages(record, sid, n_ops),
        held_through_forward=flags(record.held_through_forward),
        output_storages=np.array([sid.get(k, -1) for k in record.output_storages], dtype=np.int64),
        saved_inputs=np.asarray(record.saved_inputs if record.saved_inputs is not None else [], dtype=bool),
        storage_saved_at=ranks(record.saved_at),
        storage_rebuilt_read_at=ranks(record.rebuilt_read_at) if record.rebuilt_read_at else [],
        storage_made_from=[tuple(sorted(sid[k] for k in record.made_from.get(key, ()) if k in sid)) for key in tracked]
        if record.made_from else [],
        storage_deadline=np.array([record.deadline.get(k, -1) for k in tracked], dtype=np.int64)
        if record.deadline else np.zeros(0, dtype=np.int64),
        node_op=np.asarray(record.node_op, dtype=np.int64),
        grad_start=np.asarray(record.grad_start, dtype=np.int64),
        rerun_grad_side=np.asarray(record.rerun_grad_side, dtype=np.int64).reshape(-1, 2),
        grad_peak=np.asarray(record.grad_peak, dtype=np.int64),
        grad_after_release=np.asarray(record.grad_after, dtype=np.int64),
        grad_peak_freed=np.asarray(record.grad_peak_freed, dtype=np.int64),
        backward_seconds=np.asarray(record.backward_seconds, dtype=float),
        cost_source=record.cost_source,
        output_uses=record.output_uses,
        materialized_in_forward=flags(record.materialized_in_forward),
        materialized_when_rebuilt=flags(record.materialized_when_rebuilt),
        saved_buffer=flags(record.saved_buffer),
        storage_fused_from=np.array([record.fused_from.get(k, -1) for k in tracked], dtype=np.int64)
        if record.fused_from else np.zeros(0, dtype=np.int64),
        storage_taken_at=np.array([record.taken_at.get(k, -1) for k in tracked], dtype=np.int64)
        if record.taken_at else np.zeros(0, dtype=np.int64),
        storage_rerun_into=np.array([sid.get(record.rerun_into.get(k, -1), -1) for k in tracked], dtype=np.int64)
        if record.rerun_into else np.zeros(0, dtype=np.int64),
        storage_kernel_start=np.array([record.kernel_start.get(k, (-1,))[0] for k in tracked], dtype=np.int64)
        if record.kernel_start else np.zeros(0, dtype=np.int64),
        storage_kernel_late=np.array([not record.kernel_start.get(k, (-1, True))[1] for k in tracked], dtype=bool)
        if record.kernel_start else np.zeros(0, dtype=bool),
        storage_library_made=flags(record.library_made),
        kernel_of_rank=np.asarray(record.kernel_of_rank, dtype=np.int64),
        storage_read_in_rerun=np.array([record.read_in_rerun.get(k, (-1, -1, -1)) for k in tracked], dtype=np.int64)
        if record.read_in_rerun else np.zeros((0, 3), dtype=np.int64),
        recompute_shared=record.recompute_shared,
    )


def _op_storages(record: StepRecord, sid: dict[int, int], n_ops: int) -> list[tuple[int, ...]]:
    """Per op: the tracked storages of the values its nodes output: its own, and (``views_hold_bases``) those its
    views share."""
    found: list[set[int]] = [set() for _ in range(n_ops)]
    for node, keys in record.node_keys.items():
        op = record.op_of_node[node]
        found[op].update(sid[k] for k in keys if k in sid and (record.views_hold_bases or record.producer[k] == op))
    return [tuple(sorted(storages)) for storages in found]
