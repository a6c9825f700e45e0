"""The longest sequence one training step fits in a memory budget, at batch 1, per way of running it.

    python benchmarks/longest_sequence.py --device cuda --budget 24GiB --out docs/longest_sequence_cuda.md

A Llama-3.2-1B-shaped model (Hugging Face ``LlamaForCausalLM``, random-initialised: 16 layers, hidden 2,048,
intermediate 8,192, 32 query heads of 64 over 8 key-value heads, vocabulary 128,256, tied embeddings; ``--shape
tiny`` for a 2-layer check of the script), float32 parameters under bfloat16 autocast, SDPA attention. One step is
the forward with labels and the backward (no optimizer). Its peak is :func:`sublinear.measure`'s (CUDA's caching
allocator from before the step, plus the parameters, buffers and inputs held then), gradients None before the step:
parameters and their gradients are in it. A length fits when that peak is at or below the budget; out of memory
or a ``sublinear.BudgetError`` is a length that does not fit.

Per mode, lengths are multiples of ``--granularity``: from ``--start`` (for sublinear, by default three times Hugging
Face checkpointing's longest, the target) doubling until a length does not fit, then halving the bracket until it
is one granularity wide or the mode's ``--time-limit`` is spent (the bracket is then reported as it stands).

- ``eager``: ``model(input_ids=ids, labels=ids).loss.backward()``;
- ``hf-checkpointing``: the same after ``model.gradient_checkpointing_enable()``;
- ``sublinear``: ``sublinear.apply(model, SublinearMemoryConfig(memory_budget=--budget, compiler=--compiler,
  chunk_lm_heads=True))`` (the head is chunked by default only where inductor runs the graph), each length in its
  own process (its own capture, plan and compile); the measured step is the third.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "mid": dict(vocab_size=128256, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),  # the 1B's vocabulary, for a CPU
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def build(shape: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=1 << 20, attn_implementation="sdpa", **SHAPES[shape])
    with torch.device(device):
        return LlamaForCausalLM(config).train()


def measure_length(model, mode: str, length: int, budget: int, device: str, compiler: str) -> dict:
    """One length: the peak of a step of ``mode`` (the sublinear mode plans and compiles first), or why it failed."""
    import sublinear

    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    run = model
    if mode == "sublinear":
        run = sublinear.apply(model, sublinear.SublinearMemoryConfig(memory_budget=budget, compiler=compiler,
                                                                     cache_dir="", chunk_lm_heads=True))

    def step(_model=None, _ids=None):  # measured with the model and the ids as arguments: both are counted
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    result = {"mode": mode, "length": length}
    try:
        started = time.perf_counter()
        for _ in range(2 if mode == "sublinear" else 1):  # sublinear: capture, plan and compile; then a planned step
            step()
            model.zero_grad(set_to_none=True)
        result["warmup_s"] = time.perf_counter() - started
        result["peak_bytes"] = sublinear.measure(step, model, ids).peak_bytes
        plan = model.__dict__.get("sublinear_plan")
        if plan is not None:
            result["predicted_bytes"] = plan.predicted_peak_bytes
            result["time_ratio"] = plan.time_ratio
    except (torch.OutOfMemoryError, sublinear.BudgetError) as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        model.zero_grad(set_to_none=True)
        if mode == "sublinear":
            sublinear.remove(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    result["fits"] = "error" not in result and result["peak_bytes"] <= budget
    return result


def _in_subprocess(args, length: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        subprocess.run([sys.executable, __file__, "--shape", args.shape, "--device", args.device, "--budget",
                        args.budget, "--compiler", args.compiler, "--one", "sublinear", str(length), path],
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}, check=False)
        if os.path.exists(path):
            return json.load(open(path))
    return {"mode": "sublinear", "length": length, "fits": False, "error": "the run died"}


def search(try_length, start: int, granularity: int, time_limit: float) -> tuple[int, int | None, list[dict]]:
    """Doubling from ``start`` then bisection: (longest fitting, shortest failing or None, every trial)."""
    trials, fits, fails = [], 0, None
    length, began = start, time.perf_counter()
    while time.perf_counter() - began < time_limit:
        result = try_length(length)
        print(json.dumps(result), flush=True)
        trials.append(result)
        if result["fits"]:
            fits = length
        else:
            fails = length
            if fits == 0 and length > granularity:  # the start did not fit: halve down to a fitting length
                length = max(granularity, length // 2 // granularity * granularity)
                continue
        if fails is None:
            length *= 2
            continue
        if fails - fits <= granularity:
            break
        length = (fits + fails) // 2 // granularity * granularity
    return fits, fails, trials


def report(rows: list[tuple], command: str, args, budget: int) -> str:
    from sublinear.core.units import format_bytes

    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    lines = ["# The longest sequence in a memory budget", "", __doc__.split("\n\n", 2)[2].strip(), "",
             f"Command: `{command}`", "",
             f"{device}, torch {torch.__version__}, shape {args.shape}, budget {format_bytes(budget)}, "
             f"sublinear's compiler {args.compiler}.", "",
             "| mode | longest fitting | first not fitting | × hf-checkpointing | peak at the longest | predicted | "
             "predicted time ratio | trials |", "|---|---|---|---|---|---|---|---|"]
    reference = next((fits for mode, fits, _, _ in rows if mode == "hf-checkpointing"), None)
    for mode, fits, fails, trials in rows:
        best = next((t for t in trials if t["length"] == fits and t["fits"]), {})
        ratio = f"{fits / reference:.2f}" if reference else "–"
        predicted = format_bytes(best["predicted_bytes"]) if "predicted_bytes" in best else "–"
        time_ratio = f"x{best['time_ratio']:.2f}" if "time_ratio" in best else "–"
        peak = format_bytes(best["peak_bytes"]) if best else "–"
        lines.append(f"| {mode} | {fits:,} | {f'{fails:,}' if fails else 'not reached'} | {ratio} | {peak} | "
                     f"{predicted} | {time_ratio} | {len(trials)} |")
    lines += ["", "Trials (length: measured peak, or the error):", ""]
    for mode, _, _, trials in rows:
        lines.append(f"- {mode}: " + "; ".join(
            f"{t['length']:,}: {format_bytes(t['peak_bytes']) if 'peak_bytes' in t else t.get('error', '?')}"
            for t in trials))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--modes", default="hf-checkpointing,sublinear")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--sublinear-start", type=int, default=None)
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds of search per mode")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=3, metavar=("MODE", "LENGTH", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from sublinear.config import parse_size
    budget = parse_size(args.budget)
    if args.one:
        mode, length, path = args.one
        result = measure_length(build(args.shape, args.device), mode, int(length), budget, args.device,
                                args.compiler)
        with open(path, "w") as f:
            json.dump(result, f)
        return
    rows, model = [], None
    for mode in args.modes.split(","):
        if mode == "sublinear":
            reference = next((fits for m, fits, _, _ in rows if m == "hf-checkpointing" and fits), None)
            start = args.sublinear_start or (3 * reference if reference else args.start)
            rows.append((mode, *search(lambda n: _in_subprocess(args, n), start, args.granularity, args.time_limit)))
            continue
        model = model or build(args.shape, args.device)
        if mode == "hf-checkpointing":
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        rows.append((mode, *search(lambda n: measure_length(model, mode, n, budget, args.device, args.compiler),
                                   args.start, args.granularity, args.time_limit)))
    text = report(rows, " ".join(["python benchmarks/longest_sequence.py", *sys.argv[1:]]), args, budget)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
