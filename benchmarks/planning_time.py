"""Planning time with 20 genetic generations: capture, profile and search seconds on the meta device.

    python benchmarks/planning_time.py --out docs/planning_time.md

Cases: ResNet-50 @224 and BERT-base @512 at their max batch under 11 GiB and predicted time <= 1.35 (planned for
that budget), Hugging Face BERT-base likewise, a 2000-layer MLP (Linear + GELU, width 64, batch 256) and the
Llama-7B configuration (transformers' default LlamaConfig: 32 layers, hidden 4096) at sequence 2048, batch 1, the
last two without a budget (the lowest peak within predicted time 1.35).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
import time

import functools

import torch

import sublinear
from sublinear.capture.dynamo import capture
from sublinear.models import get_model
from sublinear.models.hf import hf_model
from sublinear.planners import make_plan
from sublinear.profiling.graph import profile
from sublinear.runtime import collecting_new_objects_only

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import Chain  # noqa: E402  (the tests' long chain)


def cases():
    """(label, model builder, (args, kwargs) at the batch, memory budget or None)."""
    budget = 11 * 2**30
    for name, batch in (("resnet50", 584), ("bert-base", 141)):
        spec = get_model(name)
        yield f"{name} @ batch {batch}", spec.build, spec.example_inputs(batch, device="meta"), budget
    hf = hf_model("BertForSequenceClassification")
    yield "hf:BertForSequenceClassification @ batch 137", hf.build, hf.example_inputs(137, device="meta"), budget
    mlp_input = ((torch.empty(256, 64, device="meta"),), {})
    yield "2000-layer MLP @ batch 256", functools.partial(Chain, 2000, 64), mlp_input, None
    llama = hf_model("LlamaForCausalLM")
    yield "Llama-7B config, seq 2048 @ batch 1", llama.build, llama.example_inputs(1, device="meta", seq=2048), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--genetic-iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    command = "python benchmarks/planning_time.py " + " ".join(sys.argv[1:])
    lines = [f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; one process, "
             f"genetic_nr_iter={options.genetic_iters}. Command: `{command}`", "",
             "| case | ops | capture s | profile s | search s | total s | plan |", "|---|---|---|---|---|---|---|"]
    for label, build, (args, kwargs), budget in cases():
        with torch.device("meta"):
            model = build().train()
        config = sublinear.SublinearMemoryConfig(genetic_nr_iter=options.genetic_iters, memory_budget=budget,
                                                 num_worker=1, cache_dir="")
        with collecting_new_objects_only():  # as sublinear.compile plans
            started = time.perf_counter()
            captured = capture(model, args, kwargs)
            captured_at = time.perf_counter()
            graph_profile = profile(captured.graphs[0])
            profiled_at = time.perf_counter()
            result = make_plan(graph_profile, config)
            done = time.perf_counter()
        sim = result.simulation
        plan = (f"{result.plan.num_blocks} blocks, peak {sim.peak_bytes / 2**30:.2f} GiB, predicted time "
                f"x{sim.time_ratio:.3f}, by {result.origin.split(' (')[0]}")
        lines.append(f"| {label} | {graph_profile.num_ops} | {captured_at - started:.1f} | "
                     f"{profiled_at - captured_at:.1f} | {done - profiled_at:.1f} | {done - started:.1f} | {plan} |")
        print(lines[-1], flush=True)
    if options.out:
        with open(options.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
