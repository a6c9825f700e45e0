import logging
import random
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import sublinear.planners.genetic as genetic
from sublinear.config import SublinearMemoryConfig
from sublinear.core import Candidate, Plan
from sublinear.planners import make_plan
from sublinear.planners.genetic import (crossover, merge_blocks, move_boundary, split_block, toggle_kept,
                                        toggle_soft)
from sublinear.planners.grid import grid_plans
from sublinear.simulation.timeline import simulate

from conftest import Chain, problem_for, profile_of


def _profile(module, batch=16, width=8):
    return profile_of(module, torch.randn(batch, width))


def grid_search(p):
    return grid_plans(problem_for(p))


def genetic_search(p, seeds, config, memory_budget=None):
    """The genetic search on a fresh problem for ``p`` (no time cap) with ``config``'s search settings."""
    fields = {f: getattr(config, f) for f in ("genetic_nr_iter", "genetic_pool_size", "num_worker", "seed")}
    return genetic.genetic_search(problem_for(p, memory_budget=memory_budget, **fields), seeds)


def score(c):
    return 0, c.simulation.peak_bytes, c.simulation.recompute_seconds, c.plan.num_blocks


@pytest.fixture(scope="module")
def chain_profile():
    torch.manual_seed(0)
    return _profile(Chain(30), batch=512)  # activations outweigh parameters: plans matter


def _config(**kwargs):
    """The genetic search's settings, with no budget the lowest peak (its own objective, not the knee)."""
    return SublinearMemoryConfig(**{"genetic_nr_iter": 6, "genetic_pool_size": 8, "num_worker": 1,
                                    "min_memory_per_time": 0, **kwargs})


def _last_start(plan: Plan) -> int:
    return plan.split_points[-2] + 1 if plan.num_blocks > 1 else 0


@st.composite
def plans(draw, max_ops: int = 40):
    """(num_ops, a valid plan whose kept ops lie outside the last block, with soft points, pinned ops)."""
    n = draw(st.integers(1, max_ops))
    inner = draw(st.sets(st.integers(0, n - 2), max_size=n - 1)) if n > 1 else set()
    plan = Plan.of(inner, n)
    kept = draw(st.sets(st.integers(0, _last_start(plan) - 1), max_size=8)) if _last_start(plan) else set()
    soft = draw(st.sets(st.sampled_from(plan.split_points[:-2]))) if plan.num_blocks > 2 else set()
    pinned = draw(st.sets(st.integers(0, n - 1), max_size=8))
    return n, Plan(plan.split_points, frozenset(kept), frozenset(soft)), frozenset(pinned)


def _assert_valid(plan: Plan, n: int) -> None:
    plan.validate(n)
    assert list(plan.split_points) == sorted(set(plan.split_points))
    assert plan.split_points[-1] == n - 1
    assert all(k < _last_start(plan) for k in plan.kept)
    assert plan.soft <= set(plan.split_points[:-2])


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_split_block_inserts_one_point_inside_a_block(case, rng):
    n, plan, _ = case
    child = split_block(plan, rng)
    _assert_valid(child, n)
    if all(len(b) == 1 for b in plan.blocks()):
        assert child == plan
    else:
        assert child.num_blocks == plan.num_blocks + 1
        assert set(plan.split_points) < set(child.split_points)
        assert child.kept == plan.kept


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_merge_blocks_removes_one_point_never_the_last(case, rng):
    n, plan, _ = case
    child = merge_blocks(plan, rng)
    _assert_valid(child, n)
    if plan.num_blocks == 1:
        assert child == plan
    else:
        assert child.num_blocks == plan.num_blocks - 1
        assert set(child.split_points) < set(plan.split_points)
        assert child.kept <= plan.kept


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_move_boundary_stays_between_its_neighbours(case, rng):
    n, plan, _ = case
    child = move_boundary(plan, rng)
    _assert_valid(child, n)
    old, new = plan.split_points, child.split_points
    assert len(new) == len(old) and new[-1] == old[-1]
    moved = [i for i in range(len(old)) if old[i] != new[i]]
    gaps = [old[i + 1] - (old[i - 1] if i else -1) for i in range(len(old) - 1)]
    if all(g <= 2 for g in gaps):
        assert child == plan
    else:
        (i,) = moved
        assert (old[i - 1] if i else -1) < new[i] < old[i + 1]


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_toggle_kept_flips_one_eligible_op(case, rng):
    n, plan, pinned = case
    child = toggle_kept(plan, rng, pinned)
    _assert_valid(child, n)
    assert child.split_points == plan.split_points
    flipped = plan.kept ^ child.kept
    if set(range(_last_start(plan))) <= pinned:
        assert child == plan
    else:
        (op,) = flipped
        assert op not in pinned and op < _last_start(plan)


@settings(max_examples=100, deadline=None)
@given(plans(), st.data(), st.randoms(use_true_random=False))
def test_crossover_keeps_a_valid_plan_made_of_its_parents(case, data, rng):
    n, a, _ = case
    inner = data.draw(st.sets(st.integers(0, n - 2), max_size=n - 1)) if n > 1 else set()
    b = Plan.of(inner, n)
    child = crossover(a, b, rng)
    _assert_valid(child, n)
    assert set(child.split_points) <= set(a.split_points) | set(b.split_points)
    assert child.kept <= a.kept
    cut_low = max([p for p in child.split_points if p not in b.split_points], default=-1)
    assert all(p in b.split_points for p in child.split_points if p > cut_low)
    assert all(p in a.split_points for p in child.split_points if p <= cut_low)


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms(use_true_random=False))
def test_toggle_soft_flips_one_point_never_the_last_two(case, rng):
    n, plan, _ = case
    child = toggle_soft(plan, rng)
    _assert_valid(child, n)
    assert (child.split_points, child.kept) == (plan.split_points, plan.kept)
    if plan.num_blocks <= 2:
        assert child == plan
    else:
        (point,) = plan.soft ^ child.soft
        assert point in plan.split_points[:-2]


@pytest.mark.slow
def test_nested_plans_cut_blocks_with_soft_points(chain_profile):
    n = chain_profile.num_ops
    base = Plan.of([9, 19], n)
    nested = genetic.nested_plans(chain_profile, [base], parts=(2,))
    (plan,) = nested
    _assert_valid(plan, n)
    assert set(base.split_points) < set(plan.split_points)
    assert plan.soft == set(plan.split_points) - set(base.split_points)  # only the new points are soft
    assert len(plan.split_points) == len(base.split_points) + 2  # each block but the last cut in two


def test_operators_change_plans():
    """The operators above are not the identity (the properties would also hold for it)."""
    n = 20
    plan = Plan.of([4, 9, 14], n)
    rng = random.Random(0)
    for op in (split_block, merge_blocks, move_boundary, toggle_kept, toggle_soft):
        assert op(plan, rng) != plan, op.__name__
    assert crossover(plan, Plan.of([1, 2, 3], n), random.Random(1)) not in (plan, Plan.of([1, 2, 3], n))


def test_uniform_plans_are_valid_and_distinct(chain_profile):
    n = chain_profile.num_ops
    uniform = genetic.uniform_plans(chain_profile)
    assert len(set(uniform)) > 10
    for plan in uniform:
        _assert_valid(plan, n)
    assert Plan.of(range(n // 2 - 1, n, n // 2), n) in uniform  # two equal blocks of ops


def test_never_worse_than_the_best_seed(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    found = genetic_search(chain_profile, seeds, _config())
    best_seed = min((Candidate(p, simulate(chain_profile, p)) for p in seeds), key=score)
    assert score(found.best) <= score(best_seed)
    assert found.best.simulation == simulate(chain_profile, found.best.plan)
    found.best.plan.validate(chain_profile.num_ops)


def test_budget_objective_finds_less_recompute_within_the_budget(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    lowest = genetic_search(chain_profile, seeds, _config()).best.simulation
    eager = simulate(chain_profile, Plan.no_split(chain_profile.num_ops))
    budget = (lowest.peak_bytes + eager.peak_bytes) // 2
    objective = problem_for(chain_profile, memory_budget=budget).objective
    found = genetic_search(chain_profile, seeds, _config(), memory_budget=budget)
    best_seed = min((Candidate(p, simulate(chain_profile, p)) for p in seeds), key=objective)
    assert found.best.simulation.peak_bytes <= budget
    assert objective(found.best) <= objective(best_seed)
    assert found.best.simulation.recompute_seconds < lowest.recompute_seconds


def test_improves_on_every_plan_it_starts_from(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    start = [*seeds, Plan.no_split(chain_profile.num_ops), *genetic.uniform_plans(chain_profile)]
    found = genetic_search(chain_profile, seeds, _config())
    assert found.best.simulation.peak_bytes < min(simulate(chain_profile, p).peak_bytes for p in start)


def test_history_is_one_non_increasing_entry_per_generation(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    found = genetic_search(chain_profile, seeds, _config(genetic_nr_iter=7))
    assert len(found.history) == 7
    ranks = [score(c) for c in found.history]
    assert ranks == sorted(ranks, reverse=True)
    assert found.history[-1] == found.best
    assert [record["gen"] for record in found.logbook] == list(range(8))  # 0: the initial population
    assert found.logbook[0]["best"] >= found.history[0].simulation.peak_bytes


def test_deterministic_for_a_seed_and_leaves_the_global_random_state_alone(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    random.seed(1234)
    state = random.getstate()
    runs = [genetic_search(chain_profile, seeds, _config(seed=s)) for s in (0, 0, 1, 2, 3)]
    assert random.getstate() == state
    assert (runs[0].best.plan, runs[0].history) == (runs[1].best.plan, runs[1].history)
    assert len({(r.best.plan, tuple(c.plan for c in r.history), r.evaluations) for r in runs}) > 1


def test_two_workers_give_the_same_result(chain_profile):
    seeds = [c.plan for c in grid_search(chain_profile)]
    one = genetic_search(chain_profile, seeds, _config(num_worker=1, seed=3))
    two = genetic_search(chain_profile, seeds, _config(num_worker=2, seed=3))
    assert (one.best, one.history, one.evaluations) == (two.best, two.history, two.evaluations)


@pytest.mark.slow
def test_every_plan_is_simulated_once(chain_profile, monkeypatch):
    simulated = []

    def counting(profile_, plan):
        simulated.append(plan)
        return simulate(profile_, plan)

    monkeypatch.setattr(genetic, "simulate", counting)
    found = genetic_search(chain_profile, [c.plan for c in grid_search(chain_profile)], _config())
    assert len(simulated) == len(set(simulated)) == found.evaluations
    assert found.evaluations > 8 * 6  # children were scored, not only seeds


def test_one_op_graph():
    p = _profile(nn.Linear(8, 8))
    assert p.num_ops == 1
    found = genetic_search(p, [Plan.no_split(1)], _config())
    assert found.best.plan == Plan.no_split(1)
    assert len(found.history) == 6


def test_info_log_has_one_line_per_generation(chain_profile, caplog):
    with caplog.at_level(logging.INFO, logger="sublinear.genetic"):
        genetic_search(chain_profile, [c.plan for c in grid_search(chain_profile)], _config(genetic_nr_iter=4))
    lines = [r.getMessage() for r in caplog.records if r.name == "sublinear.genetic"]
    assert len(lines) == 4
    assert all(re.search(r"best peak [\d.]+ MiB at predicted time x[\d.]+ .*plans simulated, [\d.]+ s", line)
               for line in lines)


def test_planner_runs_the_genetic_search_only_when_asked(chain_profile, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("genetic search called")

    monkeypatch.setattr(genetic, "genetic_search", refuse)
    result = make_plan(chain_profile, SublinearMemoryConfig(genetic_nr_iter=0, cache_dir=""))
    assert len(result.history) == 4  # the grid, the min cut, the optimal planner and the local search
    with pytest.raises(AssertionError, match="genetic search called"):
        make_plan(chain_profile, SublinearMemoryConfig(genetic_nr_iter=1, cache_dir=""))


def test_planner_uses_the_genetic_result(chain_profile):
    grid = make_plan(chain_profile, SublinearMemoryConfig(planners=("grid",), cache_dir="", min_memory_per_time=0))
    refined = make_plan(chain_profile, _config(cache_dir=""))
    objective = refined.objective
    # the grid, the min cut, the optimal planner, each generation, the GA's result, the local search
    assert len(refined.history) == 1 + 1 + 1 + 6 + 1 + 1
    assert refined.history[0].plan == grid.plan
    ranks = [objective(c) for c in refined.history]
    assert ranks == sorted(ranks, reverse=True)  # the best objective value so far
    assert refined.history[-1].plan == refined.plan
    assert objective(Candidate(refined.plan, refined.simulation)) <= objective(Candidate(grid.plan, grid.simulation))


def test_spawned_workers_give_the_same_result(chain_profile, monkeypatch):
    """Where fork is unavailable the workers are spawned and receive the profile pickled."""
    monkeypatch.setattr(genetic.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    seeds = [c.plan for c in grid_search(chain_profile)]
    spawned = genetic_search(chain_profile, seeds, _config(genetic_nr_iter=2, seed=5, num_worker=2))
    serial = genetic_search(chain_profile, seeds, _config(genetic_nr_iter=2, seed=5))
    assert (spawned.best, spawned.history) == (serial.best, serial.history)
