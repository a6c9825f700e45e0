"""Predicted against measured peak of one training step on the meta device, for several plans per model and batch.

    python benchmarks/simulator_accuracy.py --out docs/simulator_accuracy.md
    python benchmarks/simulator_accuracy.py --models tiny-resnet,tiny-bert --batches 2,4

Each model is compiled with ``sublinear.compile`` on meta tensors (op costs estimated, no memory budget). Each plan
below is made for every graph TorchDynamo captures, applied with
``SublinearModule.use``, and one training step runs: eager (one block), the planner's default plan (the lowest peak
within ``max_time_ratio`` 1.35), a random flat plan (sqrt(n) random split points), one block per op, a random nested
plan (the same split points, half of them soft) and the plan of grid + genetic(20). Predicted: the whole step's peak,
``sublinear_plan.predicted_peak_bytes`` after the step; measured: ``sublinear.measure`` (storage tracking) of that
step. Eager activations per sample: the eager peak less parameters, buffers and gradients, over the batch.

``hf-sdpa:<Class>`` is the transformers class at 4 layers, hidden size 1,024, with SDPA attention, and
``timm:<name>`` a timm model (224x224 images): on meta, scaled dot-product attention runs as on CPU (its fused
kernel), as the plan, captured on fake CPU tensors, models it.

Hugging Face models run without an attention mask and without a KV cache: a real call on meta tensors cannot run
transformers' mask checks, nor its packed-sequence check. The uncompiled model runs those checks on the meta
tensors and fails, so eager is the compiled module's one-block plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time

import torch

import sublinear
from sublinear.core import Plan
from sublinear.models import get_model
from sublinear.training import training_step

CASES = {"resnet50": (32, 64), "bert-base": (4, 8), "gpt": (4, 8), "hf:BertForSequenceClassification": (4,),
         "hf:GPT2LMHeadModel": (2,), "hf-sdpa:LlamaForCausalLM": (4,),
         "timm:vit_small_patch16_224": (32,)}  # model -> batches, at the model's default sequence length
CONFIG = sublinear.SublinearMemoryConfig(memory_budget=None, cost_model="estimate", cache_dir="")
GENETIC = dataclasses.replace(CONFIG, planners=("grid", "genetic"), genetic_nr_iter=20)
EAGER = "eager (one block)"


def meta_model(name: str, batch: int):
    """The model on meta in training mode, and its inputs (Hugging Face: without the attention mask)."""
    if name.startswith("timm:"):
        from third_party import _import_timm

        with torch.device("meta"):
            model = _import_timm().create_model(name[len("timm:"):], pretrained=False).train()
        return model, (torch.empty(batch, 3, 224, 224, device="meta"),), {}
    if name.startswith("hf-sdpa:"):
        from sublinear.models.hf import hf_model

        spec = hf_model(name[len("hf-sdpa:"):], layers=4, hidden=1024, attn="sdpa")
    else:
        spec = get_model(name)
    with torch.device("meta"):
        model = spec.build().train()
    args, kwargs = spec.example_inputs(batch, device="meta")
    kwargs.pop("attention_mask", None)
    return model, args, kwargs


def plans_for(profile, default: Plan, rng: random.Random) -> dict[str, Plan]:
    """Every benchmarked plan of one graph, by label."""
    n = profile.num_ops
    points = rng.sample(range(n), math.isqrt(n))
    return {EAGER: Plan.no_split(n),
            "planner's default": default,
            "random flat": Plan.of(points, n),
            "one block per op": Plan.every_op(n),
            "random nested (half the splits soft)": Plan.of(points, n, soft=points[::2]),
            "grid + genetic(20)": sublinear.make_plan(profile, GENETIC).plan}


def rows(name: str, batch: int):
    """(plan label, predicted peak, measured peak, eager activation bytes per sample or None) per plan."""
    model, args, kwargs = meta_model(name, batch)
    compiled = sublinear.compile(model, args, kwargs, config=CONFIG)
    rng = random.Random(batch)
    graphs = {code: plans_for(variant.profile, variant.plan, rng)
              for code, variant in compiled.sublinear_backend.latest.items()}
    for label in next(iter(graphs.values())):
        for code, plans in graphs.items():
            compiled.use(sublinear.ParetoPoint(plans[label], 0, 0, 1.0, 1.0, code))
        report = sublinear.measure(training_step, compiled, *args, **kwargs)
        model.zero_grad(set_to_none=True)
        per_sample = None
        if label == EAGER:
            fixed = report.parameter_bytes + report.buffer_bytes + report.gradient_bytes
            per_sample = (report.peak_bytes - fixed) / batch
        yield label, compiled.sublinear_plan.predicted_peak_bytes, report.peak_bytes, per_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(CASES), help="comma separated zoo or hf: models")
    parser.add_argument("--batches", default=None,
                        help="comma separated batches for every model (default: " +
                             "; ".join(f"{m} {','.join(map(str, b))}" for m, b in CASES.items()) + ")")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the table to this markdown file")
    options = parser.parse_args()
    batches = tuple(map(int, options.batches.split(","))) if options.batches else None
    command = "python benchmarks/simulator_accuracy.py " + " ".join(sys.argv[1:])
    started = time.perf_counter()
    lines = [f"Meta device (storage tracking), op costs estimated; torch {torch.__version__}. Command: `{command}`",
             "", "| model | batch | plan | predicted MiB | measured MiB | error | eager activations / sample |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    errors = []
    for name in options.models.split(","):
        if batches is None and name not in CASES:
            parser.error(f"{name} has no default batches: give --batches")
        for batch in batches or CASES[name]:
            for label, predicted, measured, per_sample in rows(name, batch):
                errors.append(abs(predicted - measured) / measured)
                per = f"{per_sample / 2**20:,.2f} MiB" if per_sample is not None else ""
                lines.append(f"| {name} | {batch} | {label} | {predicted / 2**20:,.1f} | {measured / 2**20:,.1f} | "
                             f"{(predicted - measured) / measured:+.3%} | {per} |")
                print(lines[-1], flush=True)
    lines += ["", f"Largest error: {max(errors):.3%}; {time.perf_counter() - started:.0f} s in all."]
    print(lines[-1])
    if options.out:
        with open(options.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
