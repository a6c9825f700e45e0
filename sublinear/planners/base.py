"""The planner interface: every planner receives one :class:`PlanningProblem` and the candidates found so far, and
returns new candidates, all scored by the one simulator under the problem's objective.

A planner plugs in with :func:`register_planner`; :data:`PLANNERS` is the registry the driver walks in the order of
``SublinearMemoryConfig.planners``. What a planner proposes depends only on the problem (profile, objective,
config, seed included) and the candidates it is given: a planner that bounds its search counts work (simulations,
plans built, steps of a search), never time, so that the same seed gives the same plan in every process however
busy the machine. The clock is read for log lines and reports alone (:attr:`PlanningProblem.seconds`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.simulation.timeline import simulate

__all__ = ["PLANNERS", "Planner", "PlanningProblem", "register_planner"]

log = logging.getLogger("sublinear.planners")


@dataclass
class PlanningProblem:
    """One graph to plan: its profile, the objective, the config, and a memo of every plan simulated."""

    profile: GraphProfile
    objective: Objective
    config: SublinearMemoryConfig
    started: float = field(default_factory=time.perf_counter)
    simulations: dict[Plan, Simulation] = field(default_factory=dict)
    history: list[Candidate] = field(default_factory=list)  # best so far after each planner and each generation

    def simulate(self, plan: Plan) -> Simulation:
        sim = self.simulations.get(plan)
        if sim is None:
            sim = self.simulations[plan] = simulate(self.profile, plan)
        return sim

    def candidate(self, plan: Plan, origin: str) -> Candidate:
        return Candidate(plan, self.simulate(plan), origin)

    def candidates(self, plans: Iterable[Plan], origin: str) -> list[Candidate]:
        return [self.candidate(p, origin) for p in dict.fromkeys(plans)]

    def best(self, candidates: Iterable[Candidate]) -> Candidate:
        return min(candidates, key=self.objective)

    @property
    def seconds(self) -> float:
        """Seconds since the problem was made, for log lines and reports; no planner decides by them."""
        return time.perf_counter() - self.started


class Planner(Protocol):
    """Proposes plans for a problem, starting from the candidates found so far (best first)."""

    name: str

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        """Whether this config asks for the planner (e.g. the genetic search only when genetic_nr_iter > 0)."""

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        """New candidates; the driver keeps the best under the objective."""


PLANNERS: dict[str, Callable[[], Planner]] = {}


def register_planner(name: str, factory: Callable[[], Planner]) -> None:
    """Make ``name`` usable in ``SublinearMemoryConfig.planners``."""
    PLANNERS[name] = factory
