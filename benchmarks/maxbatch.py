"""Max batch at a memory budget: eager, hand-written torch checkpointing, sublinear plans.

    python benchmarks/maxbatch.py --model resnet50,bert-base --budget 11GiB --genetic-iters 0 [--device cuda]
        [--out docs/maxbatch.md]

Same engine as `sublinear maxbatch`; this script also writes the markdown table for docs/.
"""

import argparse
import platform
import sys
import time

import torch

from sublinear.cli import parse_size
from sublinear.config import SublinearMemoryConfig
from sublinear.maxbatch import compare
from sublinear.models import get_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50,bert-base")
    parser.add_argument("--budget", type=parse_size, default=parse_size("11GiB"))
    parser.add_argument("--genetic-iters", default="0")
    parser.add_argument("--device", choices=("meta", "cuda"), default="meta")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    iters = tuple(int(v) for v in args.genetic_iters.split(","))
    where = ("meta device (storage tracking), " + platform.processor() if args.device == "meta"
             else torch.cuda.get_device_name(0))
    command = "python benchmarks/maxbatch.py " + " ".join(sys.argv[1:])
    lines = [f"Budget {args.budget / 2**30:g} GiB, fp32, on {where}; torch {torch.__version__}. "
             f"Command: `{command}`", "",
             "| model | strategy | max batch | × eager | FLOPs ratio | planning s | peak at max (MiB) |",
             "|---|---|---|---|---|---|---|"]
    started = time.time()
    for name in args.model.split(","):
        spec = get_model(name)
        rows = compare(spec, args.budget, iters, device=args.device, seq=spec.default_seq,
                       config=SublinearMemoryConfig(), progress=lambda m: print(m, file=sys.stderr))
        eager = rows[0].max_batch or 1
        for r in rows:
            planning = f"{r.planning_seconds:.2f}" if r.planning_seconds is not None else "-"
            lines.append(f"| {name} | {r.strategy} | {r.max_batch} | {r.max_batch / eager:.2f} | "
                         f"{r.flops_ratio:.3f} | {planning} | {r.peak_bytes / 2**20:,.0f} |")
            print(lines[-1], flush=True)
    lines.append(f"\n_{time.time() - started:.0f} s in total._")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
