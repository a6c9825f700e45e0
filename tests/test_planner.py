"""Planner objectives: lowest peak, least recompute under a memory budget, lb_memory, the Pareto front."""

import copy

import pytest
import torch

import sublinear
from sublinear.config import SublinearMemoryConfig
from sublinear.models import get_model
from sublinear.planner import BudgetError, make_plan, pareto_front
from sublinear.profiler import profile
from sublinear.tracer import capture

from conftest import assert_same_training, train_steps


@pytest.fixture(scope="module")
def resnet(meta_resnet50):
    return meta_resnet50


def test_budget_below_anything_reachable_names_the_minimum(resnet):
    _, _, p = resnet
    lowest = make_plan(p).simulation.peak_bytes
    with pytest.raises(BudgetError) as info:
        make_plan(p, SublinearMemoryConfig(memory_budget=lowest // 2))
    assert info.value.smallest <= lowest
    assert f"{info.value.smallest:,} bytes" in str(info.value) and "memory_budget" in str(info.value)


def test_budget_gives_least_recompute_that_fits(resnet):
    _, _, p = resnet
    lowest = make_plan(p)
    budget = (lowest.simulation.peak_bytes + lowest.baseline.peak_bytes) // 2
    fitted = make_plan(p, SublinearMemoryConfig(memory_budget=budget))
    assert fitted.simulation.peak_bytes <= budget
    assert fitted.simulation.recompute_flops < lowest.simulation.recompute_flops
    generous = make_plan(p, SublinearMemoryConfig(memory_budget=lowest.baseline.peak_bytes))
    assert generous.simulation.recompute_flops == 0  # eager fits: nothing to recompute


def test_lb_memory_hands_memory_back_for_speed(resnet):
    _, _, p = resnet
    lowest = make_plan(p)
    floor = int(lowest.simulation.peak_bytes * 1.3)
    relaxed = make_plan(p, SublinearMemoryConfig(lb_memory=floor))
    assert lowest.simulation.peak_bytes <= relaxed.simulation.peak_bytes <= floor
    assert relaxed.simulation.recompute_flops < lowest.simulation.recompute_flops
    assert relaxed.plan.kept  # memory handed back by keeping recomputed ops


def test_pareto_points_are_non_dominated_and_span_the_trade_off(resnet):
    model, args, _ = resnet
    points = sublinear.pareto(model, args, budgets=4)
    assert len(points) >= 3
    peaks = [pt.peak_bytes for pt in points]
    flops = [pt.recompute_flops for pt in points]
    assert peaks == sorted(peaks) and flops == sorted(flops, reverse=True)
    assert flops[-1] == 0 or points[-1].flops_ratio < points[0].flops_ratio


def test_pareto_front_filter():
    from sublinear.grid import Candidate
    from sublinear.plan import Plan
    from sublinear.simulator import Simulation

    def c(peak, flops):
        return Candidate(Plan((peak,)), Simulation(peak, flops, peak, peak, ""), 0.0)

    front = pareto_front([c(3, 5), c(1, 9), c(2, 9), c(4, 1), c(5, 1), c(2, 4)])
    assert [(x.simulation.peak_bytes, x.simulation.recompute_flops) for x in front] == [(1, 9), (2, 4), (4, 1)]


def test_compile_with_a_budget_runs_exactly_and_within_it():
    spec = get_model("tiny-bert")
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(32, seq=64)
    eager = make_plan(profile(capture(model, args), args))
    budget = (eager.simulation.peak_bytes + eager.baseline.peak_bytes) // 2
    reference = copy.deepcopy(model)
    compiled = sublinear.compile(model, args, config=SublinearMemoryConfig(memory_budget=budget))
    assert compiled.sublinear_plan.kept_ops  # the budget leaves room to keep expensive ops
    measured = sublinear.measure(sublinear.profiler.training_step, compiled, *args).peak_bytes
    assert compiled.sublinear_plan.predicted_peak_bytes <= budget
    assert abs(measured - compiled.sublinear_plan.predicted_peak_bytes) / measured < 0.03
    model.zero_grad(set_to_none=True)
    assert_same_training(train_steps(reference, args), train_steps(compiled, args))  # dropout replayed exactly
