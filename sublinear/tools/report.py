"""Tables and plots of benchmark results, for the terminal and for docs/ (matplotlib is an optional extra)."""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.core.units import format_bytes
from sublinear.tools.maxbatch import StrategyResult, Tuning
from sublinear.simulation.timeline import timeline

__all__ = ["ParetoSeries", "machine", "maxbatch_markdown", "maxbatch_text", "plot_convergence", "plot_pareto",
           "plot_step_memory", "tuning_markdown"]


def machine(device: str) -> str:
    """Where figures were taken, for the line above every table."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"meta device (storage tracking) on {platform.machine()} CPU"


def _seconds(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _ratio(value: float) -> str:
    """A cost ratio, or "-" where there is none (a strategy that fits no batch)."""
    return f"{value:.3f}" if math.isfinite(value) else "-"


def maxbatch_text(model: str, rows: Sequence[StrategyResult]) -> str:
    eager = rows[0].max_batch or 1
    lines = [f"{'strategy':56s} {'max batch':>9s} {'x eager':>8s} {'time':>7s} {'FLOPs':>7s} {'planning s':>10s}"]
    lines += [f"{r.strategy:56s} {r.max_batch:9d} {r.max_batch / eager:8.2f} {_ratio(r.time_ratio):>7s} "
              f"{_ratio(r.flops_ratio):>7s} {_seconds(r.planning_seconds):>10s}" for r in rows]
    return f"{model}:\n" + "\n".join(lines)


def maxbatch_markdown(results: dict[str, Sequence[StrategyResult]], budget: int, where: str, command: str,
                      notes: Sequence[str] = ()) -> str:
    """The table of every model's rows, then ``notes`` (strategies skipped), one line each."""
    lines = [f"Budget {format_bytes(budget)} on {where}; torch {torch.__version__}. Command: `{command}`", "",
             "| model | strategy | max batch | × eager | predicted time ratio | FLOPs ratio | planning s | "
             "peak at max (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for model, rows in results.items():
        eager = rows[0].max_batch or 1
        lines += [f"| {model} | {r.strategy} | {r.max_batch} | {r.max_batch / eager:.2f} | {_ratio(r.time_ratio)} | "
                  f"{_ratio(r.flops_ratio)} | {_seconds(r.planning_seconds)} | {r.peak_bytes / 2**20:,.0f} |"
                  for r in rows]
    if notes:
        lines += ["", *(f"Note: {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def tuning_markdown(tunings: dict[str, Tuning], budget: int, seed: int, command: str) -> str:
    lines = [f"Budget {format_bytes(budget)}, fp32, {machine('meta')}, torch {torch.__version__}, seed {seed}. "
             f"Command: `{command}`", "",
             "| model | genetic_nr_iter | reference batch | best peak (MiB) | vs grid | search s | max batch | "
             "× grid | planning s at max batch |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for model, t in tunings.items():
        grid = next((r for r in t.rows if r.genetic_nr_iter == 0), None)
        for r in t.rows:
            times = f"{r.max_batch / grid.max_batch:.3f}" if grid and grid.max_batch else "-"
            lines.append(f"| {model} | {r.genetic_nr_iter} | {t.batch} | {r.peak_bytes / 2**20:,.1f} | "
                         f"{r.peak_bytes / t.history[0]:.3f} | {r.search_seconds:.2f} | {r.max_batch} | {times} | "
                         f"{_seconds(r.planning_seconds)} |")
        notes.append(f"{model}: best peak per generation at batch {t.batch} (MiB, generation 0 = grid): "
                     f"{', '.join(f'{h / 2**20:,.0f}' for h in t.history)}; best of the initial population "
                     f"{t.initial_best / 2**20:,.0f}; within 1 % of the final value from generation "
                     f"{t.converged_at}.")
    return "\n".join([*lines, "", *notes]) + "\n"


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib (pip install 'sublinear[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_convergence(tunings: dict[str, Tuning], path: str) -> None:
    """Best predicted peak per generation, relative to the grid's, for each model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for model, t in tunings.items():
        relative = [100 * h / t.history[0] for h in t.history]
        line, = ax.plot(range(len(relative)), relative, marker=".", label=f"{model} (batch {t.batch})")
        ax.axhline(100 * t.initial_best / t.history[0], color=line.get_color(), linestyle="--", linewidth=1,
                   label=f"{model}: best of the initial population")
        g = t.converged_at
        ax.axvline(g, color=line.get_color(), linestyle=":", linewidth=1)
        ax.annotate(f"converged: generation {g}", (g, relative[g]), textcoords="offset points", xytext=(6, 8),
                    color=line.get_color(), fontsize=8)
    ax.set_xlabel("generation (0: grid search)")
    ax.set_ylabel("best predicted peak, % of the grid's")
    ax.set_title("Genetic refinement: best plan per generation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class ParetoSeries:
    """One model's strategies: sublinear's Pareto plans and the references (eager and hand-written checkpointing),
    each with its peak bytes, predicted step-time ratio and measured step-time ratio (taken as ``measured_at``
    says)."""
    title: str
    front: Sequence[tuple[float, float, float]]  # (peak bytes, predicted ratio, measured ratio) per Pareto plan
    references: Sequence[tuple[str, float, float, float]]  # (label, peak bytes, predicted ratio, measured ratio)
    measured_at: str


def plot_pareto(series: Sequence[ParetoSeries], path: str) -> None:
    """Step-time ratio against peak, one panel per series: predicted (filled) and measured (hollow) ratios, the
    references as labelled squares."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 5.5), squeeze=False)
    for ax, s in zip(axes[0], series):
        peaks = [peak / 2**30 for peak, _, _ in s.front]
        line, = ax.plot(peaks, [predicted for _, predicted, _ in s.front], marker="o",
                        label="sublinear Pareto plans: predicted")
        ax.plot(peaks, [measured for _, _, measured in s.front], marker="o", linestyle=":", fillstyle="none",
                color=line.get_color(), label=f"sublinear Pareto plans: measured ({s.measured_at})")
        for k, (label, peak, predicted, measured) in enumerate(s.references):
            ax.scatter([peak / 2**30], [predicted], marker="s", color="black", zorder=3,
                       label="references: predicted" if k == 0 else None)
            ax.scatter([peak / 2**30], [measured], marker="s", facecolors="none", edgecolors="black", zorder=3,
                       label=f"references: measured ({s.measured_at})" if k == 0 else None)
            ax.annotate(label, (peak / 2**30, predicted), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("peak of one training step (GiB)")
        ax.set_ylabel("step time relative to eager")
        ax.set_title(s.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_step_memory(profile: GraphProfile, plan: Plan, path: str, title: str = "") -> None:
    """Predicted live memory at every slot of one training step (:func:`sublinear.simulation.timeline.timeline`), eager
    against ``plan``, written to ``path``: forward slots are the graph's ops, so the plan's block ends are marked at
    their ops; backward slots where the plan recomputes are shaded."""
    plt = _pyplot()
    eager, _ = timeline(profile, Plan.no_split(profile.num_ops))
    planned, labels = timeline(profile, plan)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(eager / 2**20, label=f"eager: peak {format_bytes(eager.max())}", color="tab:blue")
    ax.plot(planned / 2**20, label=f"plan ({plan.num_blocks} blocks): peak {format_bytes(planned.max())}",
            color="tab:orange")
    for i, end in enumerate(plan.split_points[:-1]):
        ax.axvline(end + 0.5, color="grey", linestyle=":", linewidth=0.8, label="block end" if i == 0 else None)
    for slot, label in enumerate(labels):
        if label.startswith("recompute"):
            ax.axvspan(slot - 0.5, slot + 0.5, color="tab:orange", alpha=0.08, linewidth=0)
    ax.axvline(profile.num_ops - 0.5, color="black", linewidth=1)
    ax.annotate("forward | backward (shaded: recompute)", (profile.num_ops - 0.5, 1),
                xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("step slot (forward ops, then recompute and backward per autograd node)")
    ax.set_ylabel("predicted live MiB")
    ax.set_title(title or "Live memory through one training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")  # the upper left holds eager's forward and the forward | backward note
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
