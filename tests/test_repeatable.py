"""Plans depend only on the profile, the config and the seed: on a machine so busy that every clock reading is an
hour after the one before (any wall-clock deadline would expire at once), the planners return what they return on
an idle one, also where their work budgets run out."""

import itertools
import time

import pytest
import torch

import sublinear.planners.local as local
import sublinear.planners.optimal as optimal
from sublinear.config import SublinearMemoryConfig
from sublinear.core import Plan
from sublinear.planners import make_plan
from sublinear.planners.grid import GridPlanner
from sublinear.planners.local import LocalSearchPlanner
from sublinear.planners.optimal import OptimalPlanner

from conftest import Chain, budget_between, problem_for, profile_of

HOUR = 3600.0


@pytest.fixture(scope="module")
def chain_profile():
    torch.manual_seed(0)
    return profile_of(Chain(12, 32), torch.randn(64, 32))


def make_the_clock_busy(monkeypatch) -> None:
    """From now on, every reading of ``time.perf_counter`` and ``time.monotonic`` is an hour after the last."""
    for name in ("perf_counter", "monotonic"):
        readings = itertools.count(getattr(time, name)(), HOUR)
        monkeypatch.setattr(time, name, lambda readings=readings: next(readings))


def proposals(planner, p, memory_budget) -> list[tuple[Plan, str]]:
    """What ``planner`` proposes for ``p`` from the grid's candidates and eager, with their origins."""
    problem = problem_for(p, memory_budget=memory_budget)
    pool = [problem.candidate(Plan.no_split(p.num_ops), "eager"), *GridPlanner().propose(problem, [])]
    found = planner().propose(problem, sorted(pool, key=problem.objective))
    return [(c.plan, c.origin) for c in found]


def same_on_a_busy_machine(monkeypatch, plan_once):
    """``plan_once()`` on an idle clock and on a busy one: the same, returned."""
    idle = plan_once()
    make_the_clock_busy(monkeypatch)
    assert plan_once() == idle
    return idle


@pytest.mark.parametrize("planner", [OptimalPlanner, LocalSearchPlanner])
@pytest.mark.parametrize("fraction", [0.3, None])
@pytest.mark.slow
def test_a_planner_proposes_the_same_plans_on_a_busy_machine(planner, fraction, chain_profile, monkeypatch):
    p = chain_profile
    budget = None if fraction is None else budget_between(p, fraction)
    assert same_on_a_busy_machine(monkeypatch, lambda: proposals(planner, p, budget))


def test_the_optimal_planner_out_of_work_is_repeatable_and_says_so(chain_profile, monkeypatch):
    """Searched over every 4th boundary first (as on a large graph), with less work than a full search needs."""
    p = chain_profile
    monkeypatch.setattr(optimal, "EXACT_OPS", 8)
    monkeypatch.setattr(optimal, "COARSE_BOUNDARIES", p.num_ops // 4)
    budget = budget_between(p, 0.5)

    def with_small_work_budgets():
        found = []
        for steps in (0, 3, 10, 30):
            monkeypatch.setattr(optimal, "WORK_PER_PROPOSE", steps * optimal.VISIT_WORK)
            found.append(proposals(OptimalPlanner, p, budget))
        return found

    found = same_on_a_busy_machine(monkeypatch, with_small_work_budgets)
    assert any("work budget" in origin for proposed in found for _, origin in proposed)


def test_the_local_search_out_of_work_is_repeatable(chain_profile, monkeypatch):
    p = chain_profile
    monkeypatch.setattr(local, "NEIGHBOUR_ENTRIES", 2 * p.num_ops)
    assert same_on_a_busy_machine(monkeypatch, lambda: proposals(LocalSearchPlanner, p, budget_between(p, 0.3)))


def test_the_pipeline_gives_the_same_plan_on_a_busy_machine(chain_profile, monkeypatch):
    p = chain_profile
    config = SublinearMemoryConfig(memory_budget=budget_between(p, 0.3), max_time_ratio=float("inf"), cache_dir="",
                                   genetic_nr_iter=3, num_worker=1)

    def plan_once():
        result = make_plan(p, config)
        return result.plan, result.origin, [c.plan for c in result.candidates]

    same_on_a_busy_machine(monkeypatch, plan_once)
