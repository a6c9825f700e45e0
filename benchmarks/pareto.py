"""Memory/time trade-off: sublinear's Pareto plans beside eager and hand-written checkpointing, with CPU wall time.

    python benchmarks/pareto.py --model resnet50,bert-base --batch 256,32 --time-batch 8,2 \
        --out docs/pareto.md --plot docs/pareto.png

For each model, at --batch on the meta device: `sublinear.pareto` (grid + genetic, least recompute for a ladder
of memory budgets), and the measured peak and FLOPs ratio of eager and the hand-written strategies. Then every
plan and strategy is run for real on the CPU at --time-batch (the same graph, so the same plan applies) and its
median step time is divided by eager's: the wall-time ratio beside each FLOPs ratio.
"""

import argparse
import platform
import statistics
import sys
import time

import torch

import sublinear
from sublinear.baselines import BASELINES
from sublinear.config import SublinearMemoryConfig
from sublinear.maxbatch import baseline_costs
from sublinear.models import get_model
from sublinear.profiler import profile, training_step
from sublinear.report import ParetoSeries, plot_pareto
from sublinear.rewriter import rewrite
from sublinear.tracer import capture


def step_seconds(module, args, kwargs, repeats):
    """Median wall time of a training step (forward, backward), after one warm-up step."""
    times = []
    for _ in range(repeats + 1):
        module.zero_grad(set_to_none=True)
        started = time.perf_counter()
        training_step(module, *args, **kwargs)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50,bert-base")
    parser.add_argument("--batch", default="256,32", help="planning batch per model (meta device)")
    parser.add_argument("--time-batch", default="8,2", help="CPU timing batch per model")
    parser.add_argument("--genetic-iters", type=int, default=20)
    parser.add_argument("--budgets", type=int, default=8, help="memory budgets between the lowest peak and eager")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    command = "python benchmarks/pareto.py " + " ".join(sys.argv[1:])
    lines = [f"Peaks and FLOPs on the meta device (storage tracking); wall time on {platform.machine()} CPU, "
             f"{torch.get_num_threads()} threads; torch {torch.__version__}. Command: `{command}`"]
    series = []
    config = SublinearMemoryConfig(genetic_nr_iter=args.genetic_iters, cache_dir="")
    for name, batch, time_batch in zip(args.model.split(","), map(int, args.batch.split(",")),
                                       map(int, args.time_batch.split(","))):
        spec = get_model(name)
        seq = spec.default_seq
        with torch.device("meta"):
            meta_model = spec.build().train()
        example, kwargs = spec.example_inputs(batch, device="meta", seq=seq)
        points = sublinear.pareto(meta_model, example, kwargs, config=config, budgets=args.budgets)
        references = baseline_costs(spec, batch, seq)
        print(f"{name}: {len(points)} Pareto plans at batch {batch}; timing at batch {time_batch}", file=sys.stderr)

        torch.manual_seed(0)
        model = spec.build().train()
        example, kwargs = spec.example_inputs(time_batch, seq=seq)
        captured = capture(model, example, kwargs)
        graph = profile(captured, example, kwargs)
        eager_s = step_seconds(model, example, kwargs, args.repeats)
        rows = [("eager", *references["eager"], 1.0)]
        for label, apply in BASELINES.items():
            rows.append((label, *references[label], step_seconds(apply(model), example, kwargs, args.repeats) / eager_s))
        for i, point in enumerate(points):
            point.plan.validate(graph.num_ops)
            module = rewrite(captured, graph, point.plan)
            rows.append((f"sublinear Pareto {i + 1} ({point.plan.num_blocks} blocks, {len(point.plan.kept)} kept)",
                         point.peak_bytes, point.flops_ratio, step_seconds(module, example, kwargs, args.repeats) / eager_s))
            print(f"  {rows[-1]}", file=sys.stderr)
        lines += ["", f"**{name}**, peak at batch {batch}{f' seq {seq}' if seq else ''}; wall time at batch {time_batch} "
                  f"(eager step {eager_s:.2f} s)", "",
                  "| strategy | peak (MiB) | FLOPs ratio | CPU wall-time ratio |", "|---|---|---|---|"]
        lines += [f"| {label} | {peak / 2**20:,.0f} | {flops:.3f} | {wall:.3f} |" for label, peak, flops, wall in rows]
        series.append(ParetoSeries(f"{name}, batch {batch}", [(p.peak_bytes, p.flops_ratio) for p in points],
                                   [(label, references[label][0], references[label][1]) for label in references]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        plot_pareto(series, args.plot)


if __name__ == "__main__":
    main()
