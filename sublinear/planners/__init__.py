"""Plan: planners behind one interface (:class:`Planner`), registered by name, run in order by :func:`make_plan`.

Built in: ``grid`` (Chen's greedy blocks over MegEngine's threshold grid, with keep variants), ``mincut`` (the
fewest bytes kept from which backward rebuilds what it reads with cheap ops, AOTAutograd's partition read as plans),
``genetic``
(MegEngine's genetic refinement, with DEAP) and ``optimal`` (the least-time plan without soft split points under a
memory model of the simulator, by dynamic programming over block boundaries) and ``local`` (hill climbing by
one-edit neighbours from the best plans found).
"""

from sublinear.planners import genetic, grid, local, mincut, optimal  # noqa: F401  (register the built-in planners)
from sublinear.planners.base import PLANNERS, Planner, PlanningProblem, register_planner
from sublinear.planners.driver import (BudgetError, PlanningResult, hand_back, lowest_plan, make_plan, objective_for,
                                       pareto_front)

__all__ = ["BudgetError", "PLANNERS", "Planner", "PlanningProblem", "PlanningResult", "hand_back", "lowest_plan",
           "make_plan", "objective_for", "pareto_front", "register_planner"]
