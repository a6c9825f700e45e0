"""Plans that re-run layers for the layers above them, predicted before compiling against the compiled step.

    python benchmarks/rerun_chain.py
    python benchmarks/rerun_chain.py --fractions 0.5,0.85 --rng inductor

A 3-layer Hugging Face GPT-2 (width 128, 4 heads, vocabulary 1,000, dropout 0.1), 4 sequences of 256 tokens, on
inductor. Each point forces one plan: blocks split at a fraction of the ops and four ops before the end, so that
the first block's layers are re-run in backward for the layers above them. The step holds the model's output
while backward runs (``out = model(...); out.loss.backward()``, as a Hugging Face loop does). Columns: the plan's
peak simulated before compiling, the compiled code's walk (``GraphPlan.compiled_peak_bytes``), the CPU allocator's
count of the step (``sublinear.measure_cpu_allocator``), and the prediction's error against each. Each point runs
in its own process.
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys

import torch


def point(fraction: float, rng: str) -> str:
    import transformers

    import sublinear
    from sublinear.core import Plan
    from sublinear.simulation.timeline import simulate

    torch._inductor.config.fallback_random = rng == "aten"
    config = transformers.GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=1000, n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (4, 256))
    plain = sublinear.SublinearMemoryConfig(memory_budget=None, max_time_ratio=math.inf, min_memory_per_time=0,
                                            cache_dir="", cost_model="estimate", chunk_lm_heads=False)

    def step(module, ids):
        out = module(input_ids=ids, labels=ids)
        out.loss.backward()
        return out

    compiled = sublinear.compile(model, example_kwargs=dict(input_ids=ids, labels=ids), config=plain)
    profile = compiled.sublinear_profile
    n = profile.num_ops
    plan = Plan.of([int(fraction * n), n - 4], n)
    before = simulate(profile, plan).peak_bytes
    compiled.use(plan)
    step(compiled, ids)
    model.zero_grad(set_to_none=True)
    measured = sublinear.measure_cpu_allocator(step, compiled, ids).peak_bytes
    walked = compiled.sublinear_plan.graphs[0].compiled_peak_bytes
    return (f"| {fraction} | {int(fraction * n)} of {n} | {before / 2**20:.2f} | {walked / 2**20:.2f} | "
            f"{measured / 2**20:.2f} | {100 * (before - walked) / walked:+.1f}% | "
            f"{100 * (before - measured) / measured:+.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.3,0.5,0.7,0.85")
    parser.add_argument("--rng", choices=("aten", "inductor", "both"), default="both",
                        help="aten: inductor's fallback_random; inductor: its own random numbers")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        print(point(float(options.one[0]), options.one[1]))
        return
    print(f"`python benchmarks/rerun_chain.py {' '.join(sys.argv[1:])}` ({platform.machine()} CPU, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__})\n")
    for rng in (("aten", "inductor") if options.rng == "both" else (options.rng,)):
        print(f"Random numbers: {'aten (fallback_random)' if rng == 'aten' else 'inductor (its own)'}\n")
        print("| split at | ops | predicted before compiling (MiB) | compiled walk | allocator | error vs walk "
              "| error vs allocator |\n|---|---|---|---|---|---|---|")
        for fraction in options.fractions.split(","):
            run = subprocess.run([sys.executable, __file__, "--one", fraction, rng], capture_output=True, text=True,
                                 check=False)
            rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
            print(rows[-1] if rows else f"| {fraction} | failed: {run.stderr.strip().splitlines()[-1:]} |",
                  flush=True)
        print()


if __name__ == "__main__":
    main()
