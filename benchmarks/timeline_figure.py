"""The figure of docs/algorithm.md: predicted live memory through one ResNet-50 training step, eager vs the grid plan.

    python benchmarks/timeline_figure.py [--model resnet50] [--batch 64] [--out docs/timeline.png]

Runs on the meta device; needs matplotlib (pip install 'sublinear[plot]').
"""

import argparse

import torch

from sublinear.grid import grid_search
from sublinear.models import get_model
from sublinear.plan import Plan
from sublinear.profiler import profile
from sublinear.simulator import timeline
from sublinear.tracer import capture


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default="docs/timeline.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = get_model(args.model)
    with torch.device("meta"):
        model = spec.build().train()
    inputs, kwargs = spec.example_inputs(args.batch, device="meta")
    p = profile(capture(model, inputs, kwargs), inputs, kwargs)
    best = grid_search(p)[0].plan
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, plan in (("eager (1 block)", Plan.no_split(p.num_ops)), (f"grid plan ({best.num_blocks} blocks)", best)):
        totals, labels = timeline(p, plan)
        ax.plot(totals / 2**30, label=label)
        if plan is best:
            for x, text in enumerate(labels):
                if text.startswith("recompute"):
                    ax.axvline(x, color="tab:orange", alpha=0.05)
    ax.axvline(p.num_ops - 0.5, color="grey", ls="--", lw=0.8)
    ax.text(p.num_ops * 0.4, ax.get_ylim()[1] * 0.95, "forward", ha="center", va="top")
    ax.text(p.num_ops * 1.8, ax.get_ylim()[1] * 0.95, "backward (shaded: recompute)", ha="center", va="top")
    ax.set_xlabel("step slot (forward ops, then recompute and backward per node)")
    ax.set_ylabel("live GiB (predicted)")
    ax.set_title(f"{args.model} batch {args.batch}: live memory through one training step (meta device)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
