"""Plan: which ops end a block, and which ops inside recomputed blocks are kept rather than recomputed.

Semantics shared by the simulator and the rewriter (see docs/algorithm.md):

- Ops run in order; ``split_points`` are the ops that end a block. The last op always ends a block.
- A storage is *retained* when it is produced by a kept op or read by a later block (or returned). Autograd
  stores retained storages as usual; every other storage it saves is dropped in forward and rebuilt in backward.
- The last block, pinned ops and ``kept`` ops are never recomputed. With the single split point ``n - 1`` nothing
  is recomputed: that plan is eager execution.
- When backward first needs a dropped storage of block ``b``, the ops of ``b`` that produce dropped storages are
  re-run (the *recompute closure*), from the retained values the block's frame holds.
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

    @staticmethod
    def no_split(num_ops: int) -> Plan:
        """One block: eager execution."""
        return Plan((num_ops - 1,) if num_ops else ())

    @staticmethod
    def every_op(num_ops: int) -> Plan:
        """One block per op."""
        return Plan(tuple(range(num_ops)))

    @staticmethod
    def of(split_points: Iterable[int], num_ops: int, kept: Iterable[int] = ()) -> Plan:
        """A valid plan from any split points: sorted, deduplicated, last op added."""
        points = sorted({int(p) for p in split_points if 0 <= int(p) < num_ops} | ({num_ops - 1} if num_ops else set()))
        return Plan(tuple(points), frozenset(int(k) for k in kept))

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

    @property
    def num_blocks(self) -> int:
        return len(self.split_points)

    def blocks(self) -> list[range]:
        starts = (0, *(p + 1 for p in self.split_points[:-1]))
        return [range(a, b + 1) for a, b in zip(starts, self.split_points)]

    def block_of(self, num_ops: int) -> list[int]:
        owner = [0] * num_ops
        for b, ops in enumerate(self.blocks()):
            for o in ops:
                owner[o] = b
        return owner
