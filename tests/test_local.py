"""The local search planner: its neighbours, its climbs and its place in the planner pipeline."""

import random

import pytest
import torch

import sublinear.planners.local as local
from sublinear.core import Plan
from sublinear.planners import make_plan
from sublinear.planners.local import LocalSearchPlanner, WorkLeft, climb, neighbours

from conftest import Chain, RandomDAG, budget_between, problem_for, profile_of


@pytest.fixture(scope="module")
def chain_profile():
    torch.manual_seed(0)
    return profile_of(Chain(12, 32), torch.randn(64, 32))


@pytest.fixture(scope="module")
def dag_profile():
    torch.manual_seed(3)
    return profile_of(RandomDAG(3, nodes=10), torch.randn(32, 64))


def _one_edit(a: Plan, b: Plan) -> bool:
    """``b`` differs from ``a`` by one split point added, removed or moved by at most two ops, one soft flag,
    or one kept op."""
    pa, pb = set(a.split_points), set(b.split_points)
    if pa == pb:
        return len(a.soft ^ b.soft) + len(a.kept ^ b.kept) == 1
    if a.kept != b.kept:
        return False
    if len(pa ^ pb) == 1:
        return True
    (old,), (new,) = pa - pb, pb - pa
    return len(pa) == len(pb) and abs(old - new) <= 2


@pytest.mark.parametrize("which", ["chain_profile", "dag_profile"])
def test_neighbours_are_valid_distinct_one_edit_plans(which, request):
    p = request.getfixturevalue(which)
    n = p.num_ops
    problem = problem_for(p)
    rng = random.Random(0)
    plans = [Plan.no_split(n), Plan.every_op(n)]
    plans += [Plan.of(rng.sample(range(n), rng.randrange(1, n)), n, kept=rng.sample(range(n), 2),
                      soft=rng.sample(range(n), 2)) for _ in range(10)]
    for plan in plans:
        found = neighbours(problem, plan)
        assert found, plan
        assert len(set(found)) == len(found) and plan not in found
        for q in found:
            q.validate(n)
            assert _one_edit(plan, q), (plan, q)


def test_climb_ends_at_a_local_optimum_and_improves_a_start_that_is_not(chain_profile):
    p = chain_profile
    budget = budget_between(p, 0.3)
    problem = problem_for(p, memory_budget=budget)
    objective = problem.objective
    start = problem.candidate(Plan.no_split(p.num_ops), "eager")
    assert not objective.accepts(start)
    end = climb(problem, objective, start, random.Random(0), WorkLeft(100_000, 10**12))
    assert objective.accepts(end)
    assert all(objective(problem.candidate(q, "")) >= objective(end) for q in neighbours(problem, end.plan))


def test_local_search_never_ranks_below_its_starts_and_is_deterministic(dag_profile):
    p = dag_profile
    budget = budget_between(p, 0.5)
    results = []
    for _ in range(2):
        before = make_plan(p, problem_for(p, memory_budget=budget, planners=("grid",)).config)
        after = make_plan(p, problem_for(p, memory_budget=budget, planners=("grid", "local")).config)
        assert after.objective(after.candidates[0]) <= before.objective(before.candidates[0])
        results.append(after.plan)
    assert results[0] == results[1]


@pytest.mark.parametrize("limit", ["EVALUATIONS", "SIMULATED_OPS"])
def test_local_search_spends_at_most_its_simulations(chain_profile, monkeypatch, limit):
    monkeypatch.setattr(local, limit, 7 * (chain_profile.num_ops if limit == "SIMULATED_OPS" else 1))
    problem = problem_for(chain_profile, memory_budget=budget_between(chain_profile, 0.2))
    start = problem.candidate(Plan.no_split(chain_profile.num_ops), "eager")
    before = len(problem.simulations)
    LocalSearchPlanner().propose(problem, [start])
    assert len(problem.simulations) - before == 7


def test_local_search_builds_no_neighbours_past_its_entries(chain_profile, monkeypatch):
    """The first neighbourhood spends the entries: its neighbours are tried, and no second one is built."""
    monkeypatch.setattr(local, "NEIGHBOUR_ENTRIES", 1)
    built = []
    monkeypatch.setattr(local, "neighbours", lambda problem, plan: built.append(plan) or neighbours(problem, plan))
    problem = problem_for(chain_profile, memory_budget=budget_between(chain_profile, 0.2))
    start = problem.candidate(Plan.no_split(chain_profile.num_ops), "eager")
    found = LocalSearchPlanner().propose(problem, [start])
    assert built == [start.plan] and len(found) <= 1
