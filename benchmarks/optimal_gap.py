"""The optimal planner against the genetic search: predicted step time at memory budgets (fractions of the eager
peak) and planning seconds, for zoo models profiled on the meta device (costs estimated).

    python benchmarks/optimal_gap.py
    python benchmarks/optimal_gap.py --models mlp2000 --budgets 0.9,0.8,0.73
    python benchmarks/optimal_gap.py --dags 400
    python benchmarks/optimal_gap.py --model-check 40

Per model and budget it plans with grid + genetic, with the optimal planner alone, and with grid + optimal +
genetic (the optimal plans seed the genetic search), and reports each plan's predicted time ratio (step time
relative to eager), the flat optimum (no kept ops), the genetic search's gap to it (negative: the genetic search
found a faster plan, with kept ops or nested blocks, which the flat optimum does not cover) and planning seconds.
``mlpN`` is a stack of N Linear(256, 256) + GELU layers at batch 256.

``--model-check N`` instead compares the memory model's peak with the simulator's on N random flat plans per
model and kept set. ``--dags N`` compares the solver with brute force (every flat plan simulated) on the test
suite's random DAGs (``tests/conftest.py``, seeds 0..N-1, 7 nodes, at most 13 ops) at 13 budgets each, where the
memory model may count more than the simulator.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
from pathlib import Path

import torch
from torch import nn

from sublinear.capture.dynamo import capture
from sublinear.config import SublinearMemoryConfig
from sublinear.core import Plan
from sublinear.models import get_model
from sublinear.planners import BudgetError, make_plan
from sublinear.planners.optimal import FlatModel, kept_sets, solve
from sublinear.profiling.graph import profile
from sublinear.simulation.timeline import simulate

MODELS = {"resnet50": 64, "bert-base": 8, "gpt": 8}  # model -> batch (sequence length: the model's default)
MLP_BATCH = 256


def profile_on_meta(name: str, batch: int):
    if name.startswith("mlp"):
        with torch.device("meta"):
            model = nn.Sequential(*(m for _ in range(int(name[3:])) for m in (nn.Linear(256, 256), nn.GELU())))
            args, kwargs = (torch.empty(batch, 256),), {}
    else:
        spec = get_model(name)
        with torch.device("meta"):
            model = spec.build()
        args, kwargs = spec.example_inputs(batch, device="meta")
    return profile(capture(model.train(), args, kwargs).graph, cost_model="estimate")


def plan(p, planners: tuple[str, ...], budget: int, generations: int):
    """The planning result, or None when nothing fits."""
    config = SublinearMemoryConfig(planners=planners, genetic_nr_iter=generations, max_time_ratio=math.inf,
                                   cache_dir="", seed=0)
    try:
        return make_plan(p, config, memory_budget=budget)
    except BudgetError:
        return None


def time_ratio(result) -> float | None:
    return None if result is None else result.simulation.time_ratio


def seconds(result) -> str:
    return "—" if result is None else f"{result.seconds:.2f}"


def flat_optimum(result, budget: int) -> float | None:
    """The optimal planner's plan without kept ops (the flat optimum), as a time ratio."""
    flat = [] if result is None else \
        [c for c in result.candidates if c.origin.startswith("optimal (flat:") and c.simulation.peak_bytes <= budget]
    return min((c.simulation.time_ratio for c in flat), default=None)


def dag_gaps(count: int) -> list[str]:
    """Brute force against the solver on random DAGs: how often the solver's plan is the fastest that fits."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import RandomDAG, profile_of  # the test suite's graphs

    graphs = budgets = exact = 0
    gaps, missed = [], []
    for seed in range(count):
        torch.manual_seed(seed)
        p = profile_of(RandomDAG(seed, nodes=7, width=8), torch.randn(16, 8))
        n = p.num_ops
        if n > 13:
            continue
        graphs += 1
        sims = [simulate(p, Plan.of([o for o in range(n - 1) if mask >> o & 1], n)) for mask in range(2 ** (n - 1))]
        peaks = sorted({s.peak_bytes for s in sims})
        model = FlatModel(p)
        for budget in peaks[::max(1, len(peaks) // 12)][:12] + [peaks[0] - 1]:
            budgets += 1
            best = min((s.recompute_seconds for s in sims if s.peak_bytes <= budget), default=math.inf)
            found = solve(model, budget)
            if found.plan is None and not math.isinf(best):
                missed.append(seed)
            elif found.plan is None or found.seconds <= best + 1e-12:
                exact += 1
            else:
                gaps.append((found.seconds - best) / p.step_seconds)
    return [(f"{graphs} random DAGs (seeds 0..{count - 1} with at most 13 ops), {budgets} budgets: the solver's "
             f"plan is the fastest flat plan that fits at {exact}; slower at {len(gaps)} (by "
             f"{', '.join(f'{g:.1%}' for g in sorted(gaps))} of the eager step); no plan found where one fits at "
             f"{len(missed)} (seeds {', '.join(map(str, missed)) or '-'}).")]


def model_check(models: list[str], count: int) -> list[str]:
    """Per model and kept set: on how many of ``count`` random flat plans the model's peak is the simulator's."""
    rng = random.Random(0)
    lines = []
    for name in models:
        p = profile_on_meta(name, MODELS.get(name, MLP_BATCH))
        n = p.num_ops
        for label, kept in kept_sets(p):
            model = FlatModel(p, kept)
            plans = [model.plan([o for o in range(n - 1) if rng.random() < density] + [n - 1])
                     for density in rng.choices([0.01, 0.03, 0.1, 0.3], k=count)]
            equal = sum(model.peak(plan) == simulate(p, plan).peak_bytes for plan in plans)
            lines.append(f"{name} ({n} ops), {label or 'no kept ops'}: model peak = simulated peak on {equal} of "
                         f"{count} random flat plans")
    return lines


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo models")
    parser.add_argument("--budgets", default="0.9,0.7,0.5,0.4", help="fractions of the eager peak")
    parser.add_argument("--generations", type=int, default=20, help="genetic_nr_iter")
    parser.add_argument("--dags", type=int, help="instead compare with brute force on this many random DAGs")
    parser.add_argument("--model-check", type=int, help="instead compare the memory model with the simulator on "
                                                          "this many random plans per model and kept set")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.dags or args.model_check:
        lines = dag_gaps(args.dags) if args.dags else model_check(args.models.split(","), args.model_check)
        print("\n".join(lines))
        return 0
    caption = (f"Meta device, op costs estimated, {platform.machine()} CPU, torch {torch.__version__}, "
               f"genetic_nr_iter={args.generations}, seed 0, no time cap. Time ratio: predicted step time / eager's "
               f"(— : no plan fits). GA gap: grid + genetic minus the flat optimum (negative: the genetic search, "
               f"with kept ops and nested blocks, is faster).")
    header = ("| model | batch | budget | budget (MiB) | grid + genetic | s | flat optimum | optimal planner | s | "
              "GA gap | grid + optimal + genetic | s |")
    lines = [caption, "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.models.split(","):
        batch = MODELS.get(name, MLP_BATCH)
        p = profile_on_meta(name, batch)
        eager = simulate(p, Plan.no_split(p.num_ops)).peak_bytes
        for fraction in (float(f) for f in args.budgets.split(",")):
            budget = int(fraction * eager)
            genetic = plan(p, ("grid", "genetic"), budget, args.generations)
            best = plan(p, ("optimal",), budget, 0)
            seeded = plan(p, ("grid", "optimal", "genetic"), budget, args.generations)
            flat = flat_optimum(best, budget)
            gap = f"{time_ratio(genetic) - flat:+.4f}" if genetic is not None and flat is not None else "—"
            line = (f"| {name} | {batch} | {fraction:g} | {budget / 2**20:,.0f} | {ratio(time_ratio(genetic))} | "
                    f"{seconds(genetic)} | {ratio(flat)} | {ratio(time_ratio(best))} | {seconds(best)} | {gap} | "
                    f"{ratio(time_ratio(seeded))} | {seconds(seeded)} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
