import math

import pytest
import torch

from sublinear.core import Plan
from sublinear.planners.grid import greedy_plan, grid_plans, keep_variants
from sublinear.simulation.timeline import simulate

from conftest import Chain, problem_for, profile_of

# One worker runs every test of the ResNet-50 profile, so the session makes it once.
pytestmark = pytest.mark.xdist_group("meta_resnet50")


def grid_search(p, tries=10):
    return grid_plans(problem_for(p, thresh_nr_try=tries))


def score(c):
    """The objective without a budget or time cap: lowest peak, then least time, then fewer blocks."""
    return 0, c.simulation.peak_bytes, c.simulation.recompute_seconds, c.plan.num_blocks


@pytest.fixture(scope="module")
def resnet_profile(meta_resnet50):
    return meta_resnet50[2]


@pytest.fixture(scope="module")
def chain_profile():
    x = torch.randn(64, 8)
    return profile_of(Chain(50), x)


@pytest.mark.slow
def test_infinite_threshold_is_one_block_and_tiny_threshold_splits_everywhere(chain_profile):
    n = chain_profile.num_ops
    for measure in ("rebuild", "live"):
        assert greedy_plan(chain_profile, math.inf, measure) == Plan.no_split(n)
        assert greedy_plan(chain_profile, 1, measure).num_blocks > n // 2


def test_greedy_plans_are_valid(chain_profile):
    n = chain_profile.num_ops
    for threshold in (10, 1e3, 1e4, 1e5, 1e6):
        plan = greedy_plan(chain_profile, threshold)
        plan.validate(n)
        assert list(plan.split_points) == sorted(set(plan.split_points))


@pytest.mark.parametrize("tries", [0, 1, 2, 10])
def test_grid_keeps_every_candidate_sorted_and_handles_small_thresh_nr_try(chain_profile, tries):
    candidates = grid_search(chain_profile, tries)
    assert len({c.plan for c in candidates}) == len(candidates) > 1
    assert [score(c) for c in candidates] == sorted(score(c) for c in candidates)
    assert any(c.plan == Plan.no_split(chain_profile.num_ops) for c in candidates)
    for c in candidates:
        assert c.simulation == simulate(chain_profile, c.plan)


def test_more_grid_points_never_hurt(chain_profile):
    assert score(grid_search(chain_profile, 10)[0]) <= score(grid_search(chain_profile, 1)[0])


@pytest.mark.slow
def test_grid_beats_eager_on_resnet50(resnet_profile):
    best = grid_search(resnet_profile, 10)[0]
    eager = simulate(resnet_profile, Plan.no_split(resnet_profile.num_ops))
    fixed = resnet_profile.baseline_bytes + resnet_profile.gradient_bytes
    assert best.simulation.peak_bytes - fixed < 0.45 * (eager.peak_bytes - fixed)
    assert best.simulation.recompute_flops <= resnet_profile.forward_flops
    assert best.simulation.recompute_seconds <= resnet_profile.forward_seconds


def test_grid_ranks_by_the_objective_and_keep_variants_keep_expensive_ops(chain_profile):
    problem = problem_for(chain_profile)
    candidates = grid_plans(problem)
    assert [problem.objective(c) for c in candidates] == sorted(problem.objective(c) for c in candidates)
    plan = candidates[0].plan
    for variant in keep_variants(chain_profile, plan):
        assert variant.split_points == plan.split_points and variant.kept > plan.kept
        assert simulate(chain_profile, variant).recompute_seconds < simulate(chain_profile, plan).recompute_seconds
