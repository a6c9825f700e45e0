"""Teach a compiled step's profile what its compiled code held: the simulation of a plan, slot by slot, against
the bytes the compiled forward and backward held (:mod:`sublinear.execute.compiled.step_memory`'s trace).

The trace names, at every statement of the compiled code, the nodes of the partitioned graphs it computes. Time runs
forward through the ops and backward down the ranks, and a kernel that fuses nodes of several runs where the first
of them is due. A forward statement belongs to the lowest op among the nodes it names that no statement before it
named (a buffer's origins repeat those of the fused values it is made from, computed where first named), never
before the statement that precedes it; a forward statement naming no node of the graph (an allocation, or a library
call named by another graph's node) belongs with the next that names one: to the op of a node first named there (it
allocates that kernel's buffers), else to the op running (a library call's own memory, its results taken apart after
it). A library call belongs to the latest op among its nodes even where a statement before it named them: its own
node comes after the values inductor fused into it, and the fused kernel that made its input may name it too. A
backward statement belongs to the highest rank among its backward nodes, never before the statement that
precedes it (one naming none belongs where the one before it does). A statement that only re-runs forward nodes
belongs to the rank whose recompute re-runs them under the plan, where the simulation holds them, and time goes on
from the rank before it: the compiled code may re-run a value a few ranks before the simulation does (the
partitioned graph re-runs it right before its first reader), and counted at the rank before it, the whole recompute
was taught to that rank, for every plan. Where the compiled code held more at an op's forward, or around a rank's
backward, than the simulation of the same plan says, the op's forward lesson and the rank's backward peak are
raised by the difference. The forward lesson counts at the op's forward only: a re-run of the op in backward is
compiled into backward's kernels, and what they hold is taught to the rank it runs at (counted at the re-run too,
the lesson made the taught plan's prediction exceed what its compiled code held). The profile then predicts that
plan as compiled, and every plan as held at least as much there: what a compiler adds at a slot (a kernel fused far
from its place, a copy into the layout a library call needs) is counted for every plan, never subtracted. It never
imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from sublinear.core.analysis import analyse
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.simulation.timeline import BACKWARD_SLOTS, FORWARD_SLOT, own_slots

__all__ = ["recompute_ranks", "slot_peaks", "taught", "trace_by_slot"]


def slot_peaks(profile: GraphProfile, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """The simulation of ``plan`` on ``profile``, the graph's own bytes with its parameters, buffers and inputs (no
    other graphs beside it): per op, the bytes at its forward slot; per rank, the most bytes at its recompute and
    backward slots."""
    own, kinds, ops, ranks = own_slots(profile, plan, analyse(profile, plan))
    totals = own + profile.baseline_bytes
    forward = np.zeros(profile.num_ops, dtype=np.int64)
    backward = np.zeros(len(profile.node_op), dtype=np.int64)
    is_forward = kinds == FORWARD_SLOT
    np.maximum.at(forward, ops[is_forward], totals[is_forward])
    in_backward = np.isin(kinds, BACKWARD_SLOTS) & (ranks >= 0)
    np.maximum.at(backward, ranks[in_backward], totals[in_backward])
    return forward, backward


def recompute_ranks(profile: GraphProfile, plan: Plan) -> dict[int, int]:
    """Per op the plan re-runs, the rank before whose backward it first re-runs (the highest: ranks run down)."""
    analysis = analyse(profile, plan)
    first: dict[int, int] = {}
    for op, rank in zip(analysis.recompute_pairs[1].tolist(), analysis.recompute_ranks.tolist()):
        first[op] = max(first.get(op, -1), rank)
    return first


def trace_by_slot(points: Iterable[tuple[str, int, tuple[str, ...], bool]], op_of: Mapping[str, int],
                  rank_of: Mapping[str, int], num_ops: int, rerun_at: Mapping[int, int] | None = None
                  ) -> tuple[dict[int, int], dict[int, int]]:
    """The most bytes live at each op's forward and each rank's backward, from ``points`` ((phase, live bytes with
    the parameters, buffers and inputs, node names, whether it is a library call) per statement, in order);
    ``rerun_at``: per op the plan re-runs, the rank of its recompute (:func:`recompute_ranks`). See the module
    docstring."""
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    rerun_at = rerun_at or {}
    op, rank = 0, num_ops - 1
    computed: set[str] = set()  # forward nodes a statement before has named
    waiting = 0  # the most bytes live at the forward statements naming no node since the last that named one
    for phase, live, nodes, call in points:
        if phase == "forward":
            known = [n for n in nodes if n in op_of]
            if call:
                named = [max(op_of[n] for n in known)] if known else []
            else:
                named = [op_of[n] for n in known if n not in computed]
            computed.update(nodes)
            if not known:
                waiting = max(waiting, live)
                continue
            op = max(op, min(named)) if named else op
            forward[op] = max(forward.get(op, 0), live, waiting)
            waiting = 0
        else:
            if waiting:
                forward[op] = max(forward.get(op, 0), waiting)
                waiting = 0
            named = [rank_of[n] for n in nodes if n in rank_of]
            rerun = [rerun_at[op_of[n]] for n in nodes if n in op_of and op_of[n] in rerun_at]
            rank = min(rank, max(named)) if named else rank
            slot = rank if named or not rerun else min(rank, max(rerun))
            backward[slot] = max(backward.get(slot, 0), live)
    if waiting:
        forward[op] = max(forward.get(op, 0), waiting)
    return forward, backward


def taught(profile: GraphProfile, plan: Plan, forward: Mapping[int, int], backward: Mapping[int, int]) -> GraphProfile:
    """``profile`` raised, op by op and rank by rank, to what the compiled code of ``plan`` held (``forward``: per
    op; ``backward``: per rank; as :func:`trace_by_slot` gives them)."""
    simulated_forward, simulated_backward = slot_peaks(profile, plan)
    lesson = profile.forward_lesson.copy()
    for o, held in forward.items():
        lesson[o] += max(0, held - int(simulated_forward[o]))
    raise_by = np.zeros(len(profile.node_op), dtype=np.int64)
    for r, held in backward.items():
        raise_by[r] = max(0, held - int(simulated_backward[r]))
    ops = [dataclasses.replace(op, forward_lesson_bytes=int(e)) for op, e in zip(profile.ops, lesson)]
    return dataclasses.replace(profile, ops=ops, grad_peak=profile.grad_peak + raise_by,
                               grad_after_release=profile.grad_after_release + raise_by)
