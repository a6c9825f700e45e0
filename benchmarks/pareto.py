"""Memory/time trade-off of each model: sublinear's Pareto plans beside eager, torch.utils.checkpoint around every
block and selective activation checkpointing, with predicted and measured step-time ratios.

    python benchmarks/pareto.py --model resnet50,bert-base --batch 256,32 --time-batch 8,2 \
        --out docs/pareto.md --plot docs/pareto.png

Per model, at the planning batch (--batch) on data-less tensors:

- sublinear: ``sublinear.pareto`` (grid search, then the least predicted time for --budgets memory budgets, refined
  by --genetic-iters generations), each point's predicted peak, predicted step-time ratio and FLOPs ratio;
- references: eager, ``torch.utils.checkpoint`` around every residual block or transformer layer
  (``sublinear.tools.baselines.checkpoint_blocks``), and the same with selective activation checkpointing (the outputs
  of
  matmuls, convolutions and attention kernels saved, everything else recomputed); each one's peak measured by
  ``sublinear.measure``, and its step's FLOPs and predicted time (``sublinear.profiling.costs.StepCost`` at the
  reference
  GPU's rates, the rates the plans are predicted at) over eager's.

Zoo models run on the meta device; Hugging Face models (``hf:<ModelClass>``) on fake CPU tensors, because
transformers reads input values in its eager forward. ``sublinear.pareto`` plans one graph, so a model whose step
TorchDynamo splits into several (``hf:GPT2LMHeadModel``: its loss runs as a second graph) is refused.

Then, at --time-batch on real CPU tensors, every strategy's training step (forward and backward) is timed against
eager's: in each of --repeats rounds, an eager step and then the strategy's step; the measured ratio is the median
of the rounds' ratios. The sublinear points run the plans found at the planning batch, applied by op index with
``SublinearModule.use`` to a module compiled at the time batch: the graph at the time batch has the same ops (the
script stops when their number differs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import platform
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import sublinear
from sublinear.tools.baselines import checkpoint_blocks, residual_blocks
from sublinear.capture.dynamo import capture
from sublinear.profiling.costs import REFERENCE_GPU, StepCost
from sublinear.tools.maxbatch import StepEnvironment
from sublinear.models import get_model
from sublinear.profiling.graph import profile
from sublinear.training import training_step
from sublinear.tools.report import ParetoSeries, plot_pareto

_ATTENTION_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_fused_attention_overrideable")
COMPUTE_INTENSIVE = frozenset([torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                               torch.ops.aten.convolution,
                               *(getattr(torch.ops.aten, name) for name in _ATTENTION_KERNELS
                                 if hasattr(torch.ops.aten, name))])


def save_compute_intensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing policy: keep what matmuls, convolutions and attention kernels return."""
    if op.overloadpacket in COMPUTE_INTENSIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _SelectivelyCheckpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save_compute_intensive),
                          **kwargs)


def checkpoint_blocks_selectively(model: nn.Module) -> nn.Module:
    for container, name in residual_blocks(model):
        setattr(container, name, _SelectivelyCheckpointed(getattr(container, name)))
    return model


REFERENCES = {"eager": lambda model: model,
              "checkpoint every block": checkpoint_blocks,
              "selective checkpoint every block": checkpoint_blocks_selectively}


@dataclasses.dataclass
class Strategy:
    label: str
    peak_bytes: int  # at the planning batch: measured for references, predicted for sublinear plans
    time_ratio: float  # predicted step time over eager's
    flops_ratio: float
    measured_time_ratio: float = float("nan")  # CPU wall time over eager's, at the time batch


def references(spec, batch: int, seq: int | None) -> list[Strategy]:
    """Eager and the hand-written strategies at ``batch``, on data-less tensors: measured peak, and predicted time
    and FLOPs over eager's."""
    environment = StepEnvironment.for_model(spec, "meta", None)
    measured = []
    for label, apply in REFERENCES.items():
        model = environment.build(spec)
        with environment:
            module = apply(model)
            args, kwargs = spec.example_inputs(batch, device=environment.data_device, seq=seq)
            peak = sublinear.measure(training_step, module, *args, **kwargs).peak_bytes
            model.zero_grad(set_to_none=True)
            with StepCost(REFERENCE_GPU) as cost:
                training_step(module, *args, **kwargs)
        measured.append((label, peak, cost.seconds, cost.flops))
    _, _, eager_seconds, eager_flops = measured[0]
    return [Strategy(label, peak, seconds / eager_seconds, flops / eager_flops)
            for label, peak, seconds, flops in measured]


def pareto_points(spec, batch: int, seq: int | None, config, budgets: int) -> list[sublinear.ParetoPoint]:
    with torch.device("meta"):
        model = spec.build().train()
    args, kwargs = spec.example_inputs(batch, device="meta", seq=seq)
    return sublinear.pareto(model, args, kwargs, config=config, budgets=budgets)


def point_label(k: int, plan) -> str:
    return f"sublinear {k} ({plan.num_blocks} blocks, {len(plan.kept)} kept, {len(plan.soft)} soft)"


def step_seconds(module: nn.Module, args, kwargs) -> float:
    module.zero_grad(set_to_none=True)
    started = time.perf_counter()
    training_step(module, *args, **kwargs)
    return time.perf_counter() - started


def measured_time_ratios(spec, time_batch: int, seq: int | None, points, config, repeats: int) -> list[float]:
    """CPU wall-time ratio over eager at ``time_batch`` of each reference (in REFERENCES order, eager's is 1), then
    of each point."""
    torch.manual_seed(0)
    model = spec.build().train()
    args, kwargs = spec.example_inputs(time_batch, seq=seq)
    graph = capture(model, args, kwargs).graph
    num_ops = profile(graph, cost_model="reference").num_ops
    planned_ops = points[0].plan.split_points[-1] + 1
    if num_ops != planned_ops:
        raise SystemExit(f"{spec.name}: the graph has {num_ops} ops at batch {time_batch} and {planned_ops} at the "
                         "planning batch, so the plans do not apply by op index")
    modules = [apply(copy.deepcopy(model)) for label, apply in REFERENCES.items() if label != "eager"]
    for point in points:
        modules.append(sublinear.compile(model, config=config).use(dataclasses.replace(point, graph_code=graph.code)))
    for module in [model, *modules]:  # warm-up: a compiled module captures and applies its plan at the first call
        step_seconds(module, args, kwargs)
    ratios: list[list[float]] = [[] for _ in modules]
    for _ in range(repeats):
        for k, module in enumerate(modules):
            eager = step_seconds(model, args, kwargs)
            ratios[k].append(step_seconds(module, args, kwargs) / eager)
    return [1.0, *(statistics.median(r) for r in ratios)]


def table(name: str, batch: int, time_batch: int, seq: int | None, strategies: list[Strategy]) -> list[str]:
    at = f"batch {batch}{f' seq {seq}' if seq else ''}"
    lines = ["", f"**{name}**: peaks and predicted ratios at {at}; CPU time at batch {time_batch}", "",
             f"| strategy | peak at {at} (MiB) | predicted time ratio | FLOPs ratio | measured CPU time ratio |",
             "|---|---|---|---|---|"]
    lines += [f"| {s.label} | {s.peak_bytes / 2**20:,.0f} | {s.time_ratio:.3f} | {s.flops_ratio:.3f} | "
              f"{s.measured_time_ratio:.3f} |" for s in strategies]
    return lines


def per_model(text: str, count: int, option: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if len(values) != count:
        raise SystemExit(f"{option} needs one value per model ({count}), got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50,bert-base", help="comma separated zoo or hf: models")
    parser.add_argument("--batch", default="256,32", help="planning batch per model (data-less)")
    parser.add_argument("--time-batch", default="8,2", help="CPU timing batch per model")
    parser.add_argument("--genetic-iters", type=int, default=20)
    parser.add_argument("--budgets", type=int, default=8, help="memory budgets between the lowest peak and eager")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (an eager step, then the strategy's)")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the tables to this markdown file")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the trade-off plot (needs matplotlib)")
    options = parser.parse_args()
    names = options.model.split(",")
    batches = per_model(options.batch, len(names), "--batch")
    time_batches = per_model(options.time_batch, len(names), "--time-batch")
    config = sublinear.SublinearMemoryConfig(genetic_nr_iter=options.genetic_iters, cost_model="reference",
                                             cache_dir="")
    command = "python benchmarks/pareto.py " + " ".join(sys.argv[1:])
    lines = [(f"Peaks at the planning batch on data-less tensors: measured (storage tracking) for eager and the torch "
              f"strategies, predicted for sublinear's plans. Predicted time ratio: step time at the rates of the "
              f"{REFERENCE_GPU.device} over eager's; FLOPs ratio: step FLOPs over eager's. Measured CPU time ratio: "
              f"{platform.machine()} CPU, {torch.get_num_threads()} threads, median over {options.repeats} rounds of "
              f"an eager step then the strategy's. Selective checkpoint saves what mm, addmm, bmm, convolution and "
              f"the attention kernels return and recomputes the rest; sublinear k (b blocks, k kept, s soft): a "
              f"Pareto plan's blocks, ops kept inside recomputed blocks, and soft split points (nested blocks). "
              f"torch {torch.__version__}. Command: `{command}`")]
    series = []
    for name, batch, time_batch in zip(names, batches, time_batches):
        spec = get_model(name)
        seq = spec.default_seq
        started = time.perf_counter()
        strategies = references(spec, batch, seq)
        points = pareto_points(spec, batch, seq, config, options.budgets)
        strategies += [Strategy(point_label(k, p.plan), p.peak_bytes, p.time_ratio, p.flops_ratio)
                       for k, p in enumerate(points, 1)]
        print(f"{name}: {len(points)} Pareto plans at batch {batch} ({time.perf_counter() - started:.0f} s); "
              f"timing at batch {time_batch}", file=sys.stderr, flush=True)
        for strategy, ratio in zip(strategies, measured_time_ratios(spec, time_batch, seq, points, config,
                                                                   options.repeats)):
            strategy.measured_time_ratio = ratio
        model_lines = table(name, batch, time_batch, seq, strategies)
        lines += model_lines
        print("\n".join(model_lines), flush=True)
        reference_count = len(REFERENCES)
        series.append(ParetoSeries(
            f"{name}, batch {batch}",
            [(s.peak_bytes, s.time_ratio, s.measured_time_ratio) for s in strategies[reference_count:]],
            [(s.label, s.peak_bytes, s.time_ratio, s.measured_time_ratio) for s in strategies[:reference_count]],
            f"CPU, batch {time_batch}"))
    if options.out:
        with open(options.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if options.plot:
        plot_pareto(series, options.plot)
        print(f"wrote {options.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
