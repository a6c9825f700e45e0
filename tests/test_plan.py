import pytest
from hypothesis import given, strategies as st

from sublinear.plan import Plan, PlanError


@given(st.integers(1, 60), st.lists(st.integers(-5, 80)))
def test_of_always_gives_a_valid_plan(n, points):
    plan = Plan.of(points, n)
    plan.validate(n)
    assert plan.split_points[-1] == n - 1
    assert sum(len(b) for b in plan.blocks()) == n
    owner = plan.block_of(n)
    assert owner == sorted(owner)


@pytest.mark.parametrize("points,n", [((), 3), ((0, 1), 3), ((1, 1, 2), 3), ((2, 1), 3), ((-1, 2), 3)])
def test_invalid_plans_are_rejected(points, n):
    with pytest.raises(PlanError):
        Plan(points).validate(n)


def test_kept_ops_must_exist():
    with pytest.raises(PlanError, match="kept ops"):
        Plan((2,), frozenset({5})).validate(3)


def test_empty_graph():
    Plan.no_split(0).validate(0)
    assert Plan.no_split(0).blocks() == []
