"""What planners optimise: a simulated plan (:class:`Candidate`) and the :class:`Objective` that ranks candidates.

Two objectives, both bounded by a cap on predicted step time relative to eager (``max_time_ratio``):

- no memory budget: the lowest predicted peak among plans within the time cap (MegEngine's fitness, made safe);
- a memory budget: the least predicted step time among plans whose peak fits the budget. A budget at or above the
  eager peak therefore gives eager (ratio 1.00), which every cap admits. Fitting plans over the cap rank after
  those within it and before every plan that does not fit; the driver accepts only a plan within both.

Ties go to less time, then lower peak, then fewer blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sublinear.core.plan import Plan
from sublinear.core.units import format_bytes

__all__ = ["Candidate", "Objective", "Simulation", "ratio_over"]


def ratio_over(extra: float, base: float) -> float:
    """``1 + extra / base``: a step's cost with ``extra`` added, relative to ``base`` (1 when ``base`` is 0)."""
    return 1.0 + extra / base if base > 0 else 1.0


@dataclass(frozen=True)
class Simulation:
    """The predicted cost of one training step under a plan."""

    peak_bytes: int  # everything live at the peak: parameters, buffers, inputs, gradients, activations
    recompute_flops: int
    recompute_seconds: float
    eager_seconds: float  # predicted eager step (forward and backward), the time ratio's denominator
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_slot: str  # where the peak happens, for humans
    held_after_forward_bytes: int  # activations still held when backward starts (what later graphs run beside)

    @property
    def time_ratio(self) -> float:
        """Predicted step time relative to eager's."""
        return ratio_over(self.recompute_seconds, self.eager_seconds)


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    simulation: Simulation
    origin: str = ""  # the planner (and setting) that produced it, for reports


@dataclass(frozen=True)
class Objective:
    """Ranks candidates; lower is better. ``memory_budget`` None: lowest peak within the time cap, of which the
    driver takes the knee of the peak-time front where ``min_memory_per_time`` is above 0 (the least fraction of
    eager's peak each step along the front must save per unit of step-time ratio)."""

    memory_budget: int | None = None
    max_time_ratio: float = math.inf
    min_memory_per_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.max_time_ratio >= 1.0:
            raise ValueError(f"max_time_ratio must be >= 1.0; got {self.max_time_ratio}")

    def within_time(self, c: Candidate) -> bool:
        return c.simulation.time_ratio <= self.max_time_ratio + 1e-12

    def fits(self, c: Candidate) -> bool:
        return self.memory_budget is None or c.simulation.peak_bytes <= self.memory_budget

    def accepts(self, c: Candidate) -> bool:
        return self.within_time(c) and self.fits(c)

    def __call__(self, c: Candidate) -> tuple[int, float, float, int]:
        sim = c.simulation
        blocks = c.plan.num_blocks
        if self.memory_budget is None:
            if self.within_time(c):
                return 0, sim.peak_bytes, sim.recompute_seconds, blocks
            return 1, sim.recompute_seconds, sim.peak_bytes, blocks
        # Plans that fit rank by time alone, so those within the cap come first, then fitting plans over it: a
        # plan that fits is a better step for a search towards one within the cap than a faster one that does not
        # fit (docs/algorithm.md gives the figures).
        if self.fits(c):
            return 0, sim.recompute_seconds, sim.peak_bytes, blocks
        return 1, sim.peak_bytes, sim.recompute_seconds, blocks

    def describe(self) -> str:
        cap = "" if math.isinf(self.max_time_ratio) else f", predicted time <= x{self.max_time_ratio:g} eager"
        if self.memory_budget is None and self.min_memory_per_time > 0:
            return (f"the knee of the peak-time front (each step saves at least {self.min_memory_per_time:g} % of "
                    f"eager's peak per 1 % of step time){cap}")
        if self.memory_budget is None:
            return f"lowest peak{cap}"
        return f"least time within {format_bytes(self.memory_budget)}{cap}"
