"""Step time of sublinear against ``torch.compile``'s activation memory budget, timed turn about in one process.

    python benchmarks/budget_ab.py --model bert-base --aot-budgets 0.8,0.5 --rounds 8

For each point of --aot-budgets: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at
that point, and sublinear compiled by inductor with that compiled step's measured peak as its ``memory_budget``
(the two of benchmarks/compiled.py). Both are compiled and measured first (the CPU allocator's peak of one step);
then their steps run alternately, --rounds times each, so that a machine whose speed drifts (other work, clock
changes) slows both alike. The table gives each one's median step, and sublinear's median over the partitioner's
with the spread of the per-round ratios (min-max). ``--layouts auto,on`` times sublinear in each convolution
layout (``channels_last`` None, True; ``off``: False) in the same rounds, a row each.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

import sublinear
from compiled import MIB, Bench, model_spec
from inductor_layout import LAYOUTS


def _timed(bench: Bench, model: torch.nn.Module, net: torch.nn.Module) -> float:
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    bench.step(net)
    return time.perf_counter() - started


def point(bench: Bench, budget: float, rounds: int, layouts: list[str]) -> list[str]:
    """One budget point's rows (one per sublinear layout): peaks, median steps and the ratio."""
    torch._dynamo.reset()
    aot_model = bench.model()
    aot = torch.compile(aot_model)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        _timed(bench, aot_model, aot)  # compiles under the budget
    aot_peak = bench.peak(aot)
    ours, rows = {}, []
    for layout in layouts:
        config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor", memory_budget=aot_peak,
                                                 channels_last=LAYOUTS[layout])
        model = bench.model()
        try:
            net = sublinear.compile(model, bench.args, bench.kwargs, config=config)
            _timed(bench, model, net)  # compiles, and plans again if the compiled step is over
        except sublinear.BudgetError as exc:
            rows.append(f"| {budget:g} | {layout} | {aot_peak / MIB:,.1f} | - | - | - | no plan: "
                        f"{str(exc).splitlines()[0]} |")
            continue
        ours[layout] = (model, net, bench.peak(net), [])
    theirs = []
    for _ in range(rounds):
        theirs.append(_timed(bench, aot_model, aot))
        for model, net, _peak, mine in ours.values():
            mine.append(_timed(bench, model, net))
    for layout, (_model, net, peak, mine) in ours.items():
        ratios = [m / t for m, t in zip(mine, theirs)]
        rows.append(f"| {budget:g} | {layout} | {aot_peak / MIB:,.1f} | {peak / MIB:,.1f} | "
                    f"{statistics.median(theirs) * 1e3:,.0f} | {statistics.median(mine) * 1e3:,.0f} | "
                    f"x{statistics.median(mine) / statistics.median(theirs):.3f} ({min(ratios):.3f}-{max(ratios):.3f}),"
                    f" predicted x{net.sublinear_plan.time_ratio:.3f} |")
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--batch", type=int, default=None, help="default: 16 for images, 4 for text")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--aot-budgets", default="0.8,0.5")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--layouts", default="auto", help="sublinear's convolution layouts, comma-separated: "
                        "auto (channels_last=None), on (True), off (False)")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("sublinear").setLevel(logging.INFO)  # a compiled step above its budget says so
    spec = model_spec(options.model)
    seq = options.seq if spec.default_seq else None
    batch = options.batch or (4 if spec.default_seq else 16)
    bench = Bench(options.model, batch, seq, "cpu", 0)
    shape = f"batch {batch}" + (f", sequence {seq}" if seq else "")
    lines = [f"`python benchmarks/budget_ab.py {' '.join(sys.argv[1:])}` ({options.model}, {shape}, torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads)",
             "", "| AOT budget | sublinear layout | AOT peak (MiB) | sublinear peak (MiB) | AOT step (ms) | "
             "sublinear step (ms) | "
             "sublinear / AOT (per-round range), sublinear's prediction |", "|---|---|---|---|---|---|---|"]
    for budget in (float(b) for b in options.aot_budgets.split(",")):
        lines += point(bench, budget, options.rounds, options.layouts.split(","))
    text = "\n".join(lines)
    print(text)
    if options.out:
        with open(options.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
