"""Side by side in one process: eager, ``torch.compile``, its activation memory budget, and sublinear compiled by
inductor or run by its eager executor; each training step's measured peak and step time.

    python benchmarks/compiled.py --out docs/compiled.md --plot docs/compiled.png
    python benchmarks/compiled.py --device cuda --batch 128,32,32,32 --out docs/compiled_cuda.md

Models (--model, comma-separated): the zoo's (``resnet50``, ``bert-base``, ...), ``gpt2`` (HF GPT2LMHeadModel,
GPT-2 small's default config), ``llama`` (HF LlamaForCausalLM, 8 layers, hidden 512), or any ``hf:<ModelClass>``;
random weights, nothing downloaded. Images at 224x224, batch 16; text at sequence 256, batch 4 by default. One
training step is forward, the loss (the model's own where it takes labels, else the sum of the outputs), and
backward. Rows:

- eager; ``torch.compile`` (inductor, default partition);
- ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at each of --aot-budgets;
- sublinear compiled by inductor with each of those measured peaks as its ``memory_budget`` (bytes, the same
  measure), and at --fraction of ``torch.compile``'s peak; sublinear with no budget (the lowest predicted peak
  within 1.35x predicted time: ``min_memory_per_time=0``) compiled by inductor and run by its eager executor.

Peak: on CPU the CPU allocator's own count of one step (``sublinear.measure_cpu_allocator``), on CUDA
``torch.cuda.max_memory_allocated`` less what was allocated before the step; both with the model's parameters,
buffers and inputs. Step time: the median of --steps
steps after the first (which compiles and plans). Compile seconds: the first step's time less a later step's
(sublinear's planning inside it is reported on its own). Predicted: sublinear's own prediction of the peak once
its plan compiled (the compiled code walked); the plan column gives the prediction it was searched with, before
compiling (the largest graph's step peak).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import sublinear
from sublinear.models import get_model
from sublinear.training import default_loss

MIB = 2**20


def model_spec(name: str):
    """A zoo model, ``hf:<ModelClass>``, or the issue's two transformers configs by short name."""
    if name == "gpt2":
        from sublinear.models.hf import hf_model

        return hf_model("GPT2LMHeadModel")
    if name == "llama":
        from sublinear.models.hf import hf_model

        return hf_model("LlamaForCausalLM", layers=8, hidden=512)
    return get_model(name)


@dataclass
class Row:
    label: str
    peak: int
    step: float
    compile: float
    planning: float | None = None
    predicted: int | None = None
    plan: str = ""


class Bench:
    """One model on one device: a fresh copy of the model per strategy, the same inputs and seed."""

    def __init__(self, name: str, batch: int, seq: int | None, device: str, steps: int) -> None:
        self.spec = model_spec(name)
        self.device = torch.device(device)
        self.steps = steps
        torch.manual_seed(0)
        self.state = {k: v.clone() for k, v in self.spec.build().state_dict().items()}
        self.args, self.kwargs = self.spec.example_inputs(batch, device=device, **({"seq": seq} if seq else {}))

    def model(self) -> torch.nn.Module:
        model = self.spec.build()
        model.load_state_dict(self.state)
        return model.to(self.device).train()

    def step(self, net: torch.nn.Module) -> None:
        _step(net, *self.args, **self.kwargs)

    def run(self, label: str, model: torch.nn.Module, net: torch.nn.Module, first: contextlib.AbstractContextManager
            = contextlib.nullcontext()) -> Row:
        times = []
        for k in range(self.steps + 1):
            model.zero_grad(set_to_none=True)
            self._sync()
            started = time.perf_counter()
            with first if k == 0 else contextlib.nullcontext():
                self.step(net)
            self._sync()
            times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
        peak = self.peak(net)
        step = statistics.median(times[1:])
        row = Row(label, peak, step, max(times[0] - step, 0.0))
        print(f"{label}: peak {peak / MIB:,.1f} MiB, step {step * 1e3:,.1f} ms, first step {times[0]:.1f} s",
              flush=True)
        return row

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak(self, net: torch.nn.Module) -> int:
        """The step's peak with the model's parameters and buffers and the step's inputs (token ids, attention mask
        and labels too: they are the step's memory, and sublinear's prediction counts them)."""
        if self.device.type != "cuda":
            return sublinear.measure_cpu_allocator(_step, net, *self.args, **self.kwargs).peak_bytes
        # What this step allocates beyond what was allocated before it, plus this model's parameters, buffers and
        # inputs: earlier strategies' compiled code may still hold memory of its own, which is not this step's.
        gc.collect()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step(net)
        torch.cuda.synchronize(self.device)
        inputs = [t for t in [*self.args, *self.kwargs.values()] if isinstance(t, torch.Tensor)]
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*net.parameters(), *net.buffers(), *inputs]}
        return torch.cuda.max_memory_allocated(self.device) - before + sum(own.values())


def _step(net: torch.nn.Module, *args, **kwargs) -> None:
    """One training step: forward, the model's own loss (or the outputs' sum), backward."""
    out = net(*args, **kwargs)
    loss = getattr(out, "loss", None)
    (loss if loss is not None else default_loss(out)).backward()


def sublinear_row(bench: Bench, label: str, config: sublinear.SublinearMemoryConfig) -> Row:
    model = bench.model()
    started = time.perf_counter()
    try:
        net = sublinear.compile(model, bench.args, bench.kwargs, config=config)
    except sublinear.BudgetError as exc:
        print(f"{label}: {exc}", flush=True)
        return Row(label, 0, float("nan"), 0.0, plan=f"no plan: {str(exc).splitlines()[0]}")
    planning = time.perf_counter() - started
    try:
        row = bench.run(label, model, net)  # the first call compiles, and plans again if the compiled step is over
    except sublinear.BudgetError as exc:
        print(f"{label}: {exc}", flush=True)
        return Row(label, 0, float("nan"), 0.0, plan=f"no plan: {str(exc).splitlines()[0]}")
    plan = net.sublinear_plan
    before = max((g.predicted_before_compile_bytes or g.predicted_peak_bytes for g in plan.graphs), default=0)
    chunks = [re.search(r"chunks of ([\d,]+) of ([\d,]+) tokens", head) for g in plan.graphs for head in g.lm_heads]
    heads = "".join(f", head in chunks of {m[1]} of {m[2]} tokens" for m in chunks if m)
    del net, model
    torch._dynamo.reset()
    gc.collect()
    return dataclasses.replace(row, planning=planning, predicted=plan.predicted_peak_bytes,
                               plan=f"{plan.num_blocks} blocks, predicted x{plan.time_ratio:.3f}, "
                                    f"{before / MIB:,.1f} MiB before compiling{heads}")


def compare(bench: Bench, aot_budgets: list[float], fraction: float, rows: list[Row],
            written: Callable[[], None]) -> None:
    """Append each strategy's row to ``rows`` as it is measured, and call ``written`` after each."""
    def add(row: Row) -> Row:
        rows.append(row)
        written()
        return row

    add(bench.run("eager", model := bench.model(), model))
    model = bench.model()
    default = add(bench.run("torch.compile", model, torch.compile(model)))
    aot = []
    for budget in aot_budgets:
        torch._dynamo.reset()
        model = bench.model()
        row = add(bench.run(f"torch.compile, activation_memory_budget {budget:g}", model, torch.compile(model),
                            first=torch._functorch.config.patch(activation_memory_budget=budget)))
        aot.append((budget, row.peak))
    torch._dynamo.reset()
    base = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor")
    for budget, peak in aot:
        add(sublinear_row(bench, f"sublinear inductor, budget = AOT {budget:g}'s peak",
                          dataclasses.replace(base, memory_budget=peak)))
    if fraction:
        add(sublinear_row(bench, f"sublinear inductor, budget {fraction:.0%} of torch.compile's peak",
                          dataclasses.replace(base, memory_budget=int(default.peak * fraction))))
    lowest = dataclasses.replace(base, memory_budget=None, min_memory_per_time=0)  # the lowest peak within the cap
    add(sublinear_row(bench, "sublinear inductor, no budget", lowest))
    add(sublinear_row(bench, "sublinear eager executor, no budget", dataclasses.replace(lowest, compiler="eager")))


def table(title: str, rows: list[Row]) -> list[str]:
    eager = rows[0]
    lines = [f"### {title}", "",
             "| strategy | peak (MiB) | × eager | predicted (MiB) | step (ms) | × eager | compile (s) | planning (s) "
             "| plan |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.peak:
            lines.append(f"| {r.label} | - | - | - | - | - | - | - | {r.plan} |")
            continue
        predicted = f"{r.predicted / MIB:,.1f} ({r.peak / r.predicted - 1:+.1%})" if r.predicted else "-"
        planning = f"{r.planning:.1f}" if r.planning is not None else "-"
        lines.append(f"| {r.label} | {r.peak / MIB:,.1f} | {r.peak / eager.peak:.2f} | {predicted} | "
                     f"{r.step * 1e3:,.1f} | {r.step / eager.step:.2f} | {r.compile:.1f} | {planning} | {r.plan} |")
    return lines + [""]


def plot(results: dict[str, list[Row]], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], results.items()):
        for r in rows:
            if not r.peak:
                continue
            kind = ("sublinear inductor" if r.label.startswith("sublinear inductor") else
                    "sublinear eager executor" if r.label.startswith("sublinear eager") else
                    "torch.compile + memory budget" if "activation_memory_budget" in r.label else r.label)
            marker, color = {"sublinear inductor": ("o", "tab:blue"), "sublinear eager executor": ("D", "tab:cyan"),
                             "eager": ("s", "black"), "torch.compile": ("^", "tab:orange"),
                             "torch.compile + memory budget": ("v", "tab:red")}[kind]
            ax.scatter(r.peak / MIB, r.step * 1e3, marker=marker, color=color, s=50, label=kind)
            ax.annotate(r.label.replace("sublinear inductor, ", "").replace("torch.compile, ", ""),
                        (r.peak / MIB, r.step * 1e3), textcoords="offset points", xytext=(4, 3), fontsize=7)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=8)
        ax.set_xlabel(f"peak of one training step (MiB, {device})")
        ax.set_ylabel("step time (ms)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50,bert-base,gpt2,llama")
    parser.add_argument("--batch", default=None, help="per model, comma-separated (default: 16 for images, 4 for text)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--aot-budgets", default="0.8,0.5,0.3,0.2,0.1,0.05")
    parser.add_argument("--fraction", type=float, default=0.0, help="a budget at this fraction of torch.compile's "
                        "peak (default: no such row)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    options = parser.parse_args()
    names = options.model.split(",")
    batches = [int(b) for b in options.batch.split(",")] if options.batch else [None] * len(names)
    if options.device == "cpu":
        where = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    else:
        where = torch.cuda.get_device_name(torch.device(options.device))
    lines = [f"{where}, torch {torch.__version__}. Command: `python benchmarks/compiled.py {' '.join(sys.argv[1:])}`",
             ""]
    results = {}
    for name, batch in zip(names, batches):
        spec = model_spec(name)
        seq = options.seq if spec.default_seq else None
        batch = batch or (4 if spec.default_seq else 16)
        title = f"{name}, batch {batch}" + (f", sequence {seq}" if seq else "")
        print(f"== {title}", flush=True)
        bench = Bench(name, batch, seq, options.device, options.steps)
        rows = results[title] = []

        def written() -> None:
            if options.out:
                with open(options.out, "w") as f:
                    f.write("\n".join([*lines, *(line for t, r in results.items() for line in table(t, r))]) + "\n")

        compare(bench, [float(b) for b in options.aot_budgets.split(",")], options.fraction, rows, written)
        torch._dynamo.reset()
        gc.collect()
    lines += [line for title, rows in results.items() for line in table(title, rows)]
    print("\n".join(lines))
    if options.plot:
        plot(results, options.plot, where)


if __name__ == "__main__":
    main()
