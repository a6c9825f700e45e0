"""Predicted vs measured peak of one training step, for the zoo models at two batch sizes and several plans.

    python benchmarks/simulator_accuracy.py [--out docs/simulator_accuracy.md]

Measured: sublinear.measure (storage tracking) of the eager module and of the rewritten module on the meta device.
"""

import argparse
import random
import time

import torch

import sublinear
from sublinear.config import SublinearMemoryConfig
from sublinear.grid import grid_search
from sublinear.models import get_model
from sublinear.plan import Plan
from sublinear.planner import make_plan
from sublinear.profiler import profile, training_step
from sublinear.rewriter import rewrite
from sublinear.simulator import simulate
from sublinear.tracer import capture

CASES = [("resnet50", (32, 64)), ("bert-base", (4, 8)), ("gpt", (4, 8))]


def rows():
    for name, batches in CASES:
        spec = get_model(name)
        for batch in batches:
            with torch.device("meta"):
                model = spec.build().train()
            args, kwargs = spec.example_inputs(batch, device="meta")
            captured = capture(model, args, kwargs)
            p = profile(captured, args, kwargs)
            n = p.num_ops
            eager = sublinear.measure(training_step, model, *args, **kwargs).peak_bytes
            model.zero_grad(set_to_none=True)
            fixed = p.parameter_bytes + p.buffer_bytes + p.gradient_bytes
            yield name, batch, "eager module", simulate(p, Plan.no_split(n)).peak_bytes, eager, \
                (eager - fixed) / batch
            rng = random.Random(batch)
            points = rng.sample(range(n), int(n ** 0.5))
            plans = {"grid best": grid_search(p)[0].plan,
                     "random split": Plan.of(points, n),
                     "one op per block": Plan.every_op(n),
                     "random nested (half the splits soft)": Plan.of(points, n, soft=points[::2]),
                     "grid + genetic(20), nested": make_plan(p, SublinearMemoryConfig(genetic_nr_iter=20)).plan}
            for label, plan in plans.items():
                measured = sublinear.measure(training_step, rewrite(captured, p, plan), *args, **kwargs).peak_bytes
                model.zero_grad(set_to_none=True)
                yield name, batch, label, simulate(p, plan).peak_bytes, measured, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.time()
    lines = ["| model | batch | plan | predicted MiB | measured MiB | error | eager activations / sample |",
             "|---|---|---|---|---|---|---|"]
    for name, batch, label, predicted, measured, per_sample in rows():
        per = f"{per_sample / 2**20:.2f} MiB" if per_sample else ""
        lines.append(f"| {name} | {batch} | {label} | {predicted / 2**20:,.1f} | {measured / 2**20:,.1f} | "
                     f"{(predicted - measured) / measured * 100:+.3f}% | {per} |")
        print(lines[-1], flush=True)
    lines.append(f"\n_{time.time() - started:.0f} s on the meta device, torch {torch.__version__}._")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
