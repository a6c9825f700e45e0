"""Which plans the compiled memory model predicts right: the planners' candidates at one budget, each compiled by
itself and measured.

    python benchmarks/plan_outcomes.py --model mamba --budget 807000 --fastest 6 --lowest 3

The model is one of benchmarks/compiled_memory.py's (its small config, one thread). The first training call under
``memory_budget=--budget`` is planned as usual; its search (``make_plan`` on the profile the call planned with, the
outputs' uses not yet known, so guessed held) is recorded and the call stopped before anything compiles. The plans
compiled: the ``--fastest`` distinct candidates of least predicted time predicted within the budget (the search's
choice first), and the ``--lowest`` distinct plans of lowest predicted peak within the time cap (ties by time) that a
search of that profile with no budget finds (``min_memory_per_time=0``), the first being the plan the compile check
falls back to when no plan of its taught profile fits. Each runs by itself on a fresh copy of the model
(``sublinear.compile(...).use(plan)``, two steps, the third measured by the CPU allocator).

Columns: the plan's split points, how many ops it keeps, its predicted time; "searched" is its peak on the searched
profile; "before compiling" the prediction once a call showed what the step does with the outputs (the benchmark's
step drops them before backward), against which "error" is taken; "walked" the compile check's walk of the compiled
code; "measured" the allocator's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiled_memory  # noqa: E402

import sublinear  # noqa: E402
import sublinear.runtime.pipeline as pipeline  # noqa: E402
from sublinear.core.objective import Candidate  # noqa: E402
from sublinear.planners import make_plan  # noqa: E402


class _Searched(Exception):
    """Raised by the recording search once it holds the first search at the budget."""


def searched(name: str, budget: int):
    """The profile, config and candidates (best first) of the first search at ``budget`` of a training call of
    ``name``."""
    model, args, kwargs, step = compiled_memory._build(name)
    found: list = []
    make_plan = pipeline.make_plan

    def recording(profile, config, memory_budget=None, **options):
        result = make_plan(profile, config, memory_budget=memory_budget, **options)
        if memory_budget == budget:
            found.extend((profile, config, result.candidates))
            raise _Searched
        return result

    pipeline.make_plan = recording
    config = sublinear.SublinearMemoryConfig(compiler="inductor", cache_dir="", memory_budget=budget,
                                             min_memory_per_time=0)
    try:
        for _ in range(2):
            step(sublinear.apply(model, config), *args, **kwargs)
    except _Searched:
        pass
    finally:
        pipeline.make_plan = make_plan
        torch._dynamo.reset()
    if not found:
        raise RuntimeError(f"{name}: no search at a budget of {budget:,} bytes")
    return found


def _key(candidate: Candidate) -> tuple:
    return candidate.plan.split_points, candidate.plan.kept, candidate.plan.soft


def chosen(profile, config, candidates: list[Candidate], budget: int, fastest: int,
           lowest: int) -> list[tuple[str, Candidate]]:
    """The plans to compile (see the module docstring), each with why it was chosen."""
    fitting = [c for c in candidates if c.simulation.peak_bytes <= budget]  # best first, as the search ranks them
    unbudgeted = make_plan(profile, dataclasses.replace(config, memory_budget=None), memory_budget=None).candidates
    capped = [c for c in unbudgeted if c.simulation.time_ratio <= config.max_time_ratio]
    by_peak = sorted(capped, key=lambda c: (c.simulation.peak_bytes, c.simulation.recompute_seconds))
    picked: list[tuple[str, Candidate]] = []
    for why, ordered, count in (("fastest", fitting, fastest), ("lowest", by_peak, lowest)):
        taken = 0
        for c in ordered:
            if taken == count:
                break
            if _key(c) not in {_key(p) for _, p in picked}:
                picked.append((why, c))
                taken += 1
    return picked


def outcome(name: str, candidate: Candidate) -> dict:
    """``candidate``'s plan compiled and measured by itself."""
    model, args, kwargs, step = compiled_memory._build(name)
    config = sublinear.SublinearMemoryConfig(compiler="inductor", cache_dir="", min_memory_per_time=0)
    run = sublinear.compile(model, args, kwargs, config).use(candidate.plan)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(run, *args, **kwargs)
    model.zero_grad(set_to_none=True)
    measured = compiled_memory._measured_peak(step, run, *args, **kwargs)
    graph = run.sublinear_plan.graphs[0]
    torch._dynamo.reset()
    return {"before": graph.predicted_before_compile_bytes or graph.predicted_peak_bytes,
            "walked": graph.compiled_peak_bytes, "measured": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mamba", choices=compiled_memory.MODELS)
    parser.add_argument("--budget", type=int, required=True, help="bytes")
    parser.add_argument("--fastest", type=int, default=6)
    parser.add_argument("--lowest", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(1)
    for noisy in ("transformers", "diffusers", "timm", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    inductor_config.fallback_random = True
    started = time.perf_counter()
    budget = options.budget
    rows = ["| chosen as | split points | kept ops | time | searched | before compiling | walked | measured | error "
            "| within the budget |", "|---|---|---|---|---|---|---|---|---|---|"]
    for why, candidate in chosen(*searched(options.model, budget), budget, options.fastest, options.lowest):
        result = outcome(options.model, candidate)
        sim, measured = candidate.simulation, result["measured"]
        rows.append(f"| {why} | {', '.join(map(str, candidate.plan.split_points))} | {len(candidate.plan.kept)} | "
                    f"x{sim.time_ratio:.3f} | {sim.peak_bytes:,} | {result['before']:,} | {result['walked'] or 0:,} | "
                    f"{measured:,} | {(result['before'] - measured) / measured:+.1%} | "
                    f"{'yes' if measured <= budget else 'no'} |")
        print(rows[-1], flush=True)
    print(f"\nCommand: `python benchmarks/plan_outcomes.py {' '.join(sys.argv[1:])}` "
          f"({time.perf_counter() - started:.0f} s, torch {torch.__version__})\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
