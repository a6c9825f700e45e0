"""The compiled step's peak predicted before compiling against the CPU allocator's, on random DAGs under random plans.

    python benchmarks/random_dags.py --out docs/random_dags.md
    python benchmarks/random_dags.py --seeds 0-3 --plans 2 --width 128

Each seed draws a :class:`~sublinear.models.RandomDAG` (pointwise ops, matrix products, batch and layer norms,
dropout, softmax, views and concatenations: shapes no zoo model has), compiled by ``sublinear.compile`` with inductor
and no budget. Each plan (eager's single block, then random split points with random kept ops, drawn from the seed)
is simulated on the profile made before any compile, run with ``SublinearModule.use``, and measured by the CPU
allocator over one step (the output held while backward runs, the sum of the output as the loss), after a first
step that compiles it. Then, per fraction of --budgets, the DAG compiled afresh with that fraction of eager's plan's
measured peak as its ``memory_budget``: met, over, or refused (``BudgetError``), beside the lowest peak any of the
plans above measured (a refusal where one of them measures within the budget is a budget a plan could meet).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import sublinear
from sublinear.core import Plan
from sublinear.measurement import measure_cpu_allocator
from sublinear.models import RandomDAG
from sublinear.simulation.timeline import simulate
from sublinear.training import default_loss

MIB = 2**20
_FLOOR = 256 * 1024  # a point within 2 % or 256 KiB counts as predicted


def _step(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    default_loss(out).backward()
    return out


def _dag(seed: int, nodes: int, width: int, batch: int) -> tuple[RandomDAG, torch.Tensor]:
    """One seed's DAG in training mode and its input, the same on every call."""
    torch.manual_seed(seed)
    return RandomDAG(seed, nodes=nodes, width=width).train(), torch.randn(batch, width)


def _plans(num_ops: int, count: int, rng: random.Random) -> list[tuple[str, Plan]]:
    plans = [("eager", Plan.no_split(num_ops))]
    for k in range(count):
        splits = rng.sample(range(num_ops - 1), min(num_ops - 1, rng.randint(1, 4)))
        kept = rng.sample(range(num_ops), rng.randint(0, num_ops // 4))
        plans.append((f"random {k + 1}", Plan.of(splits, num_ops, kept=kept)))
    return plans


def rows(seed: int, nodes: int, width: int, batch: int, plans: int) -> list[tuple[str, Plan, int, int]]:
    """(label, plan, predicted before compiling, measured) per plan of one seed's DAG."""
    model, x = _dag(seed, nodes, width, batch)
    net = sublinear.compile(model, (x,), config=sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor"))
    profile = net.sublinear_profile
    found = []
    for label, plan in _plans(profile.num_ops, plans, random.Random(seed)):
        predicted = simulate(profile, plan).peak_bytes
        net.use(plan)
        _step(net, x)
        model.zero_grad(set_to_none=True)
        measured = measure_cpu_allocator(_step, net, x).peak_bytes
        model.zero_grad(set_to_none=True)
        found.append((label, plan, predicted, measured))
    return found


def budget_rows(seed: int, nodes: int, width: int, batch: int, budgets: list[int]) -> list[tuple[int, str]]:
    """(budget, outcome) per budget of one seed's DAG, each compiled afresh under that ``memory_budget``."""
    found = []
    for budget in budgets:
        model, x = _dag(seed, nodes, width, batch)
        config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor", memory_budget=budget)
        try:
            net = sublinear.compile(model, (x,), config=config)
            _step(net, x)
        except sublinear.BudgetError as exc:
            found.append((budget, f"refused: {str(exc).split(': ', 1)[-1].split(' (')[0]}"))
            continue
        model.zero_grad(set_to_none=True)
        measured = measure_cpu_allocator(_step, net, x).peak_bytes
        found.append((budget, f"{'met' if measured <= budget else 'OVER'}: {measured / MIB:,.3f} MiB measured"))
    return found


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-7", help="a range (0-7) or a list (0,3,5)")
    parser.add_argument("--plans", type=int, default=2, help="random plans per seed, beside eager's")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--budgets", default="0.97,0.9", help="fractions of eager's plan's measured peak")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = ["| seed | ops | plan | blocks | predicted before compiling (MiB) | measured (MiB) | error |",
             "|---|---|---|---|---|---|---|"]
    within = total = 0
    budget_lines = ["| seed | budget (MiB) | lowest measured plan above (MiB) | outcome |", "|---|---|---|---|"]
    for seed in _seeds(options.seeds):
        found = rows(seed, options.nodes, options.width, options.batch, options.plans)
        for label, plan, predicted, measured in found:
            ok = abs(predicted - measured) <= max(0.02 * measured, _FLOOR)
            within, total = within + ok, total + 1
            lines.append(f"| {seed} | {plan.split_points[-1] + 1} | {label} | {plan.num_blocks} | "
                         f"{predicted / MIB:,.3f} | {measured / MIB:,.3f} | "
                         f"{(predicted - measured) / measured:+.1%}{'' if ok else ' (off)'} |")
            print(lines[-1], flush=True)
        lowest = min(measured for _, _, _, measured in found)
        budgets = [int(float(f) * found[0][3]) for f in options.budgets.split(",") if f]
        for budget, outcome in budget_rows(seed, options.nodes, options.width, options.batch, budgets):
            budget_lines.append(f"| {seed} | {budget / MIB:,.3f} | {lowest / MIB:,.3f} | {outcome} |")
            print(budget_lines[-1], flush=True)
    command = " ".join(["python benchmarks/random_dags.py", *sys.argv[1:]])
    text = "\n".join([
        "# Compiled step memory on random DAGs: predicted before compiling against measured", "",
        f"Command: `{command}`", "",
        f"x86_64 CPU, 1 thread, torch {torch.__version__}, {time.perf_counter() - started:.0f} s. RandomDAG with "
        f"{options.nodes} nodes, width {options.width}, batch {options.batch}; inductor, no budget. Error: predicted "
        "before compiling against the allocator's peak of the step.", "", *lines, "",
        f"Within 2 % (or 256 KiB): {within} of {total} points.", "",
        f"Budgets ({options.budgets} of eager's plan's measured peak):", "", *budget_lines, ""])
    if options.out:
        with open(options.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
