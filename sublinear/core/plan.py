"""Plan: which ops end a block, and which ops inside recomputed blocks are kept rather than recomputed.

Semantics shared by the simulator and the rewriter (read once, in :func:`sublinear.core.analysis.analyse`):

- Ops run in order; ``split_points`` are the ops that end a block. The last op always ends a block.
- A storage is *retained* when it is produced by a kept op or read by a later block (or returned). Autograd
  stores retained storages as usual; every other storage it saves is dropped in forward and rebuilt in backward.
- The last block, pinned ops and ``kept`` ops are never recomputed. With the single split point ``n - 1`` nothing
  is recomputed: that plan is eager execution.
- When backward first needs a dropped storage that block ``b`` saved, the ops producing ``b``'s dropped storages
  are re-run (the *recompute closure*), from the retained values the block's frame holds.
- ``soft`` split points end a block without keeping what crosses them: blocks joined by soft points form one
  *group*, and "a later block" above means a later group. A block's closure may then reach back into earlier
  blocks of its group and re-run them from the group's retained inputs (Chen's recursive checkpointing, flattened:
  less memory than keeping the boundary, more recompute). The boundary of the last block is never soft.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Plan", "PlanError"]


class PlanError(ValueError):
    """A plan that is not valid for the graph it is applied to."""


@dataclass(frozen=True)
class Plan:
    split_points: tuple[int, ...]
    kept: frozenset[int] = field(default_factory=frozenset)
    soft: frozenset[int] = field(default_factory=frozenset)  # split points whose crossing values are rebuilt

    @staticmethod
    def no_split(num_ops: int) -> Plan:
        """One block: eager execution."""
        return Plan((num_ops - 1,) if num_ops else ())

    @staticmethod
    def every_op(num_ops: int) -> Plan:
        """One block per op."""
        return Plan(tuple(range(num_ops)))

    @staticmethod
    def of(split_points: Iterable[int], num_ops: int, kept: Iterable[int] = (), soft: Iterable[int] = ()) -> Plan:
        """A valid plan from any split points within ``num_ops`` ops (the last op added), in normal form."""
        points = set(map(int, split_points))
        if points and (min(points) < 0 or max(points) >= num_ops):
            points = {p for p in points if 0 <= p < num_ops}
        if num_ops:
            points.add(num_ops - 1)
        return Plan.normal(points, frozenset(map(int, kept)), frozenset(map(int, soft)))

    @staticmethod
    def normal(split_points: Iterable[int], kept: Iterable[int] = (), soft: Iterable[int] = ()) -> Plan:
        """The one form of a plan whose split points end at the last op, so that plans that mean the same compare
        equal: split points sorted and unique; kept ops only outside the last block (which is never recomputed);
        soft points only among the split points before the last two. :meth:`validate` refuses any other form."""
        points = tuple(sorted(set(split_points)))
        last_start = points[-2] + 1 if len(points) > 1 else 0
        kept = frozenset(kept)
        if kept and max(kept) >= last_start:  # the common case, none in the last block, costs no scan in Python
            kept = frozenset(k for k in kept if k < last_start)
        return Plan(points, kept, frozenset(soft) & frozenset(points[:-2]))

    def as_dict(self) -> dict[str, list[int]]:
        """JSON-ready form (plan cache)."""
        return {"split_points": list(self.split_points), "kept": sorted(self.kept), "soft": sorted(self.soft)}

    @staticmethod
    def from_dict(entry: dict) -> Plan:
        return Plan(tuple(entry["split_points"]), frozenset(entry["kept"]), frozenset(entry["soft"]))

    def validate(self, num_ops: int) -> None:
        points = self.split_points
        if num_ops == 0:
            if points or self.kept:
                raise PlanError("a graph without ops takes the empty plan")
            return
        if not points or points[-1] != num_ops - 1:
            raise PlanError(f"the last op ({num_ops - 1}) must end a block; got split points {list(points)}")
        if any(b <= a for a, b in zip(points, points[1:])) or points[0] < 0:
            raise PlanError(f"split points must be strictly increasing op indices; got {list(points)}")
        bad = sorted(k for k in self.kept if not 0 <= k < num_ops)
        if bad:
            raise PlanError(f"kept ops {bad} are outside 0..{num_ops - 1}")
        last_start = points[-2] + 1 if len(points) > 1 else 0
        bad = sorted(k for k in self.kept if k >= last_start)
        if bad:
            raise PlanError(f"kept ops {bad} are in the last block, which is never recomputed; build plans with "
                            "Plan.of or Plan.normal")
        bad = sorted(self.soft - set(points[:-2]))
        if bad:
            raise PlanError(f"soft points {bad} must be split points other than the last two {list(points[-2:])}")

    @property
    def num_blocks(self) -> int:
        return len(self.split_points)

    def blocks(self) -> list[range]:
        starts = (0, *(p + 1 for p in self.split_points[:-1]))
        return [range(a, b + 1) for a, b in zip(starts, self.split_points)]

    def group_of_blocks(self) -> list[int]:
        """Per block, its group: consecutive blocks joined by soft split points."""
        groups, g = [], 0
        for b, point in enumerate(self.split_points):
            groups.append(g)
            if point not in self.soft:
                g += 1
        return groups

    def block_of(self, num_ops: int) -> list[int]:
        owner = [0] * num_ops
        for b, ops in enumerate(self.blocks()):
            for o in ops:
                owner[o] = b
        return owner
