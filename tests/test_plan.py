import pytest
from hypothesis import given, strategies as st

from sublinear.core.plan import Plan, PlanError


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


def test_soft_points_and_groups():
    plan = Plan.of([2, 5, 8], 12, soft=[2, 5, 8, 11, 7])  # 8 ends the block before the last: cannot be soft
    assert plan.soft == {2, 5}
    assert plan.group_of_blocks() == [0, 0, 0, 1]
    assert Plan.from_dict(plan.as_dict()) == plan
    with pytest.raises(PlanError, match="soft points"):
        Plan((2, 5, 8, 11), soft=frozenset({8})).validate(12)
    with pytest.raises(PlanError, match="soft points"):
        Plan((2, 5, 8, 11), soft=frozenset({3})).validate(12)


def test_one_normal_form_so_plans_that_mean_the_same_compare_equal():
    n = 10
    a = Plan.of([3, 6], n, kept=[1, 8], soft=[3, 9])  # op 8 is in the last block; 9 cannot be soft
    b = Plan.normal([9, 6, 3, 3], kept=[1], soft=[3])
    assert a == b and a.kept == {1} and a.soft == {3}
    with pytest.raises(PlanError, match="last block"):
        Plan((3, 6, 9), frozenset({8})).validate(n)


@given(st.integers(1, 40), st.lists(st.integers(-5, 50)), st.lists(st.integers(0, 39)), st.lists(st.integers(0, 39)))
def test_of_is_the_normal_form_in_plain_ints_whatever_integers_it_is_given(n, points, kept, soft):
    import json

    import numpy as np

    plan = Plan.of(np.array(points, dtype=np.int64), n, np.array(kept, dtype=np.int32), [np.int64(s) for s in soft])
    expected_points = sorted({p for p in points if 0 <= p < n} | {n - 1})
    last_start = expected_points[-2] + 1 if len(expected_points) > 1 else 0
    assert list(plan.split_points) == expected_points
    assert plan.kept == {k for k in kept if k < last_start}
    assert plan.soft == set(soft) & set(expected_points[:-2])
    assert Plan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan
