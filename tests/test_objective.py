"""The objective: how plans rank under a memory budget and a time cap, and what the driver accepts."""

import pytest
import torch

from sublinear.core import Plan
from sublinear.planners import BudgetError, make_plan
from sublinear.planners.local import LocalSearchPlanner

from conftest import Chain, budget_between, problem_for, profile_of


@pytest.fixture(scope="module")
def chain_profile():
    torch.manual_seed(0)
    return profile_of(Chain(12, 32), torch.randn(64, 32))


def test_capped_objective_ranks_fitting_plans_over_the_cap_above_plans_that_do_not_fit(chain_profile):
    """Under a budget, the climbs rank any plan that fits above every plan that does not, whatever the cap; plans
    within both still rank first, and the driver accepts only those."""
    p = chain_profile
    budget = budget_between(p, 0.5)
    problem = problem_for(p, memory_budget=budget, max_time_ratio=1.0)
    objective = problem.objective
    fits = make_plan(p, problem_for(p, memory_budget=budget, planners=("grid",)).config).candidates[0]
    over = problem.candidate(Plan.no_split(p.num_ops), "")  # eager: within every cap, over the budget
    assert objective.fits(fits) and not objective.within_time(fits) and objective.within_time(over)
    assert objective(fits) < objective(over)
    assert not objective.accepts(fits) and not objective.accepts(over)
    problem.simulations = {over.plan: over.simulation}
    ends = LocalSearchPlanner().propose(problem, [over])
    assert ends and any(objective.fits(c) for c in ends)
    with pytest.raises(BudgetError, match="the fastest plan that fits needs time"):
        make_plan(p, problem.config)
