"""What the compile check teaches, rank by rank: the simulation of a compiled plan against what its code held.

    python benchmarks/lessons.py --model resnet50 --batch 16 --aot-budget 0.8
    python benchmarks/lessons.py --model resnet50 --batch 16 --no-budget

The budget is the measured peak of ``torch.compile`` at ``activation_memory_budget=--aot-budget`` (as in
benchmarks/budget_ab.py). sublinear plans for it and compiles; at the first compile check the profile is taught what
the compiled code held. ``--no-budget``: the plan of the lowest predicted peak within the time cap
(``min_memory_per_time=0``), as benchmarks/compiled.py's no-budget row. Printed: every op (forward) and rank
(backward) where the code held more or less than the simulation of the same plan by more than --min-mib, then the
plans' predicted and measured peaks. A positive difference is memory the model misses.
"""

from __future__ import annotations

import argparse
import logging

import torch

import sublinear
import sublinear.runtime.compile_check as compile_check
from compiled import MIB, Bench, model_spec
from sublinear.simulation.calibration import slot_peaks


def reporting(min_bytes: float):
    """``taught`` that first prints, per op and per rank, the code's bytes against the simulation's."""
    teach = compile_check.taught

    def taught(profile, plan, forward, backward):
        simulated_forward, simulated_backward = slot_peaks(profile, plan)
        rows = [("forward", o, profile.ops[o].name, held, int(simulated_forward[o])) for o, held in forward.items()]
        rows += [("backward", r, profile.ops[int(profile.node_op[r])].name, held, int(simulated_backward[r]))
                 for r, held in backward.items()]
        print("| phase | op or rank | name | held (MiB) | simulated (MiB) | held - simulated (MiB) |")
        print("|---|---|---|---|---|---|")
        for phase, at, name, held, simulated in sorted(rows, key=lambda row: row[4] - row[3]):
            if abs(held - simulated) > min_bytes:
                print(f"| {phase} | {at} | {name} | {held / MIB:,.2f} | {simulated / MIB:,.2f} | "
                      f"{(held - simulated) / MIB:+,.2f} |", flush=True)
        return teach(profile, plan, forward, backward)
    return taught


def _aot_peak(bench: Bench, aot_budget: float) -> int:
    """The measured peak of ``torch.compile`` at ``activation_memory_budget=aot_budget``."""
    model = bench.model()
    aot = torch.compile(model)
    with torch._functorch.config.patch(activation_memory_budget=aot_budget):
        bench.step(aot)
    model.zero_grad(set_to_none=True)
    peak = bench.peak(aot)
    torch._dynamo.reset()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--aot-budget", type=float, default=0.8)
    parser.add_argument("--min-mib", type=float, default=1.0)
    parser.add_argument("--no-budget", action="store_true", help="the lowest peak within the time cap, no budget")
    options = parser.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("sublinear").setLevel(logging.INFO)
    spec = model_spec(options.model)
    bench = Bench(options.model, options.batch, options.seq if spec.default_seq else None, "cpu", 0)
    budget = None if options.no_budget else _aot_peak(bench, options.aot_budget)
    compile_check.taught = reporting(options.min_mib * MIB)
    ours = bench.model()
    config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor", memory_budget=budget,
                                             min_memory_per_time=0)
    net = sublinear.compile(ours, bench.args, bench.kwargs, config=config)
    bench.step(net)
    ours.zero_grad(set_to_none=True)
    predicted = net.sublinear_plan.predicted_peak_bytes
    asked = "none" if budget is None else f"{budget / MIB:,.1f} MiB"
    before = net.sublinear_plan.graphs[0].predicted_before_compile_bytes
    measured = bench.peak(net)
    print(f"budget {asked}; the plan run: predicted {before / MIB:,.1f} MiB before compiling ({before:,} bytes), "
          f"{predicted / MIB:,.1f} MiB as taught ({predicted:,}); measured {measured / MIB:,.1f} MiB ({measured:,})")


if __name__ == "__main__":
    main()
