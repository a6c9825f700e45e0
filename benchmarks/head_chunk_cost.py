"""What the chunked LM head and loss cost in step time: ``torch.compile``, and sublinear with no recompute (its plan
set to one block with ``use()``) with the head chunked and unchunked, turn about in one process.

    python benchmarks/head_chunk_cost.py --model llama --batch 4 --seq 256 --rounds 5

Models as in benchmarks/compiled.py (``llama``: HF LlamaForCausalLM, 8 layers, hidden 512, vocabulary 32,000).
Each mode runs two steps first (compile, plan); then each round steps every mode once, and the median per mode is
reported with the rounds' times. sublinear's plan summary names the chunk it chose.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sublinear
from compiled import Bench
from sublinear.core import Plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    bench = Bench(options.model, options.batch, options.seq, "cpu", 0)
    modes = {}
    model = bench.model()
    modes["torch.compile"] = (model, torch.compile(model))
    for chunked in (True, False):
        model = bench.model()
        config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor", chunk_lm_heads=chunked)
        net = sublinear.compile(model, bench.args, bench.kwargs, config=config)
        net.use(Plan.no_split(net.sublinear_profile.num_ops))
        modes[f"sublinear, head {'chunked' if chunked else 'unchunked'}, no recompute"] = (model, net)
    for name, (model, net) in modes.items():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            bench.step(net)
        if name.startswith("sublinear"):
            print(f"{name}: {net.sublinear_plan}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(options.rounds):
        for name, (model, net) in modes.items():
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            bench.step(net)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["torch.compile"])
    print(f"\n{options.model}, batch {options.batch}, sequence {options.seq}, {torch.get_num_threads()} threads\n")
    print("| mode | step (ms) | × torch.compile | rounds (ms) |\n|---|---|---|---|")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {median * 1e3:,.1f} | {median / base:.3f} | {', '.join(f'{t * 1e3:,.0f}' for t in ts)} |")


if __name__ == "__main__":
    main()
