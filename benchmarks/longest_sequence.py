"""The longest sequence one training step fits in a memory budget, at batch 1, per way of running it.

    python benchmarks/longest_sequence.py --device cuda --budget 24GiB --out docs/longest_sequence_cuda.md
    python benchmarks/longest_sequence.py --device meta --budget 24GiB --modes eager,hf-checkpointing,sublinear

A Llama-3.2-1B-shaped model (Hugging Face ``LlamaForCausalLM``, random-initialised: 16 layers, hidden 2,048,
intermediate 8,192, 32 query heads of 64 over 8 key-value heads, vocabulary 128,256, tied embeddings; ``--shape
tiny`` for a 2-layer check of the script), float32 parameters under bfloat16 autocast, SDPA attention. One step is
the forward with labels and the backward (no optimizer). Its peak is :func:`sublinear.measure`'s (CUDA's caching
allocator from before the step, or every storage the step's ops make, plus the parameters, buffers and inputs held
then), gradients None before the step: parameters and their gradients are in it. A length fits when that peak is
at or below the budget; out of memory or a ``sublinear.BudgetError`` is a length that does not fit.

``--device meta`` runs every step data-less, as ``sublinear maxbatch`` runs transformers models under autocast
(:class:`sublinear.tools.maxbatch.StepEnvironment`): the model is built on meta and twinned onto fake CPU tensors
of one ``FakeTensorMode`` (dispatch cache off), the steps run under ``torch.autocast("cpu", torch.bfloat16)`` and
sublinear plans with ``cost_model="reference"`` (the reference GPU's rates: the fakes stand for a GPU's step) on its
eager executor. The peak counts the storages the step's ops return, so it holds no allocator rounding and no
library workspace.

Per mode, lengths are multiples of ``--granularity``: from ``--start`` (for sublinear, by default three times Hugging
Face checkpointing's longest, the target) doubling until a length does not fit, then halving the bracket until it
is one granularity wide or the mode's ``--time-limit`` is spent (the bracket is then reported as it stands).

- ``eager``: ``model(input_ids=ids, labels=ids).loss.backward()``;
- ``hf-checkpointing``: the same after ``model.gradient_checkpointing_enable()``;
- ``sublinear``: ``sublinear.apply(model, SublinearMemoryConfig(memory_budget=--budget, compiler=--compiler,
  chunk_lm_heads=True, cache_dir=""))`` (the head is chunked by default only where inductor runs the graph), each
  length in its own process (its own capture, plan and compile); the measured step is the third, the first two
  capture and plan it. Its planning seconds are the plan's own (profile and search of every graph).
"""

from __future__ import annotations

import argparse
import contextlib
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


def environment(device: str):
    """On meta, the data-less environment every step, plan and measurement runs in (fake CPU tensors under bf16
    autocast); None on a real device."""
    if device != "meta":
        return None
    from sublinear.tools.maxbatch import StepEnvironment
    return StepEnvironment("meta", torch.bfloat16, fake=True)


def build(shape: str, device: str, env=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    from sublinear.models import ModelSpec

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=1 << 20, attn_implementation="sdpa", **SHAPES[shape])
    if env is not None:  # built on meta, then twinned onto the environment's fakes; only the spec's build is read
        spec = ModelSpec(shape, "Llama", lambda: LlamaForCausalLM(config), lambda *a, **k: ((), {}), None)
        return env.build(spec)
    with torch.device(device):
        return LlamaForCausalLM(config).train()


def token_ids(vocab: int, length: int, device: str, env=None) -> torch.Tensor:
    """``[1, length]`` token ids: random on a real device, fake ones of the environment's mode on meta (no step
    reads their values there)."""
    if env is not None:
        with env.fake:
            return torch.zeros((1, length), dtype=torch.long, device=env.data_device)
    return torch.randint(0, vocab, (1, length), device=device, generator=torch.Generator(device).manual_seed(1))


def sublinear_config(budget: int, device: str, compiler: str):
    import sublinear

    data_less = {"cost_model": "reference"} if device == "meta" else {}
    return sublinear.SublinearMemoryConfig(memory_budget=budget, compiler=compiler, cache_dir="",
                                           chunk_lm_heads=True, **data_less)


def measure_length(model, mode: str, length: int, budget: int, device: str, compiler: str, env=None) -> dict:
    """One length: the peak of a step of ``mode`` (the sublinear mode plans and compiles first), or why it failed."""
    import sublinear

    ids = token_ids(model.config.vocab_size, length, device, env)
    run = sublinear.apply(model, sublinear_config(budget, device, compiler)) if mode == "sublinear" else model
    autocast = env.autocast_context if env is not None else lambda: torch.autocast(device, dtype=torch.bfloat16)

    def step(_model=None, _ids=None):  # measured with the model and the ids as arguments: both are counted
        with autocast():
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    result = {"mode": mode, "length": length}
    try:
        with env if env is not None else contextlib.nullcontext():
            started = time.perf_counter()
            for _ in range(2 if mode == "sublinear" else 1):  # sublinear: capture, plan and compile; then planned
                step()
                model.zero_grad(set_to_none=True)
            result["warmup_s"] = time.perf_counter() - started
            result["peak_bytes"] = sublinear.measure(step, model, ids).peak_bytes
        plan = model.__dict__.get("sublinear_plan")
        if plan is not None:
            result.update(predicted_bytes=plan.predicted_peak_bytes, time_ratio=plan.time_ratio,
                          blocks=plan.num_blocks, planning_s=sum(g.planning_seconds for g in plan.graphs))
    except (torch.OutOfMemoryError, sublinear.BudgetError) as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if isinstance(exc, sublinear.BudgetError):
            result.update(lowest_bytes=exc.smallest, lowest_time_ratio=exc.lowest.simulation.time_ratio)
    finally:
        model.zero_grad(set_to_none=True)
        if mode == "sublinear":
            sublinear.remove(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    result["fits"] = "error" not in result and result["peak_bytes"] <= budget
    return result


def _in_subprocess(args, length: int) -> dict:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        subprocess.run([sys.executable, __file__, "--shape", args.shape, "--device", args.device, "--budget",
                        args.budget, "--compiler", args.compiler, "--one", "sublinear", str(length), path],
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}, check=False)
        result = json.load(open(path)) if os.path.exists(path) else \
            {"mode": "sublinear", "length": length, "fits": False, "error": "the run died"}
    return {**result, "process_s": time.perf_counter() - started}


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


def machine(device: str) -> str:
    import platform

    import transformers

    if device == "cuda":
        where = torch.cuda.get_device_name()
    elif device == "meta":
        where = f"{platform.machine()} CPU, fake CPU tensors standing for the reference GPU (no data, no kernels)"
    else:
        where = f"{platform.machine()} CPU"
    return f"{where}, torch {torch.__version__}, transformers {transformers.__version__}"


def gib(nbytes: int) -> str:
    """Bytes in GiB to the MiB: peaks near the budget differ by less than format_bytes's three figures."""
    return f"{nbytes / 2**30:.3f} GiB"


def _trial(t: dict) -> str:
    """One trial: its length, measured peak (or error), and for a plan its prediction, time and planning."""
    if "peak_bytes" in t:
        text = f"{t['length']:,}: {gib(t['peak_bytes'])}"
    elif "lowest_bytes" in t:
        text = (f"{t['length']:,}: BudgetError (lowest plan {gib(t['lowest_bytes'])} at "
                f"x{t['lowest_time_ratio']:.2f})")
    else:
        text = f"{t['length']:,}: {t.get('error', '?')}"
    if "predicted_bytes" in t:
        text += (f" (predicted {gib(t['predicted_bytes'])}, x{t['time_ratio']:.2f}, {t['blocks']} blocks, "
                 f"planned in {t['planning_s']:.0f} s)")
    if "process_s" in t:
        text += f" [{t['process_s']:.0f} s]"
    return text


def report(rows: list[tuple], command: str, args, budget: int) -> str:
    from sublinear.core.units import format_bytes

    lines = ["# The longest sequence in a memory budget", "", __doc__.split("\n\n", 2)[2].strip(), "",
             f"Command: `{command}`", "",
             f"{machine(args.device)}; shape {args.shape}, budget {format_bytes(budget)} ({budget:,} bytes), "
             f"sublinear's compiler {args.compiler}.", "",
             "| mode | longest fitting | first not fitting | × hf-checkpointing | peak at the longest | predicted | "
             "predicted time ratio | planning (profile + search) | trials |", "|---|---|---|---|---|---|---|---|---|"]
    reference = next((fits for mode, fits, _, _ in rows if mode == "hf-checkpointing"), None)
    for mode, fits, fails, trials in rows:
        best = next((t for t in trials if t["length"] == fits and t["fits"]), {})
        ratio = f"{fits / reference:.2f}" if reference else "–"
        predicted = gib(best["predicted_bytes"]) if "predicted_bytes" in best else "–"
        time_ratio = f"x{best['time_ratio']:.2f}" if "time_ratio" in best else "–"
        planning = f"{best['planning_s']:.0f} s" if "planning_s" in best else "–"
        peak = gib(best["peak_bytes"]) if best else "–"
        lines.append(f"| {mode} | {fits:,} | {f'{fails:,}' if fails else 'not reached'} | {ratio} | {peak} | "
                     f"{predicted} | {time_ratio} | {planning} | {len(trials)} |")
    lines += ["", "Trials (length: measured peak, or the error; for sublinear its predicted peak, predicted step time "
              "over eager's, blocks and planning seconds, and in brackets its process's wall time):", ""]
    for mode, _, _, trials in rows:
        lines.append(f"- {mode}: " + "; ".join(_trial(t) for t in trials))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda", "meta"))
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--modes", default="hf-checkpointing,sublinear")
    parser.add_argument("--compiler", default=None, choices=("inductor", "eager"),
                        help="sublinear's executor (default inductor; eager on meta, where nothing is compiled)")
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--sublinear-start", type=int, default=None)
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds of search per mode")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=3, metavar=("MODE", "LENGTH", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "meta" and args.compiler == "inductor":
        parser.error("--device meta runs sublinear's eager executor: inductor compiles no fake-tensor step")
    args.compiler = args.compiler or ("eager" if args.device == "meta" else "inductor")
    return args


def main() -> None:
    args = parse_args()
    from sublinear.config import parse_size
    budget = parse_size(args.budget)
    env = environment(args.device)
    if env is not None:
        torch.set_num_threads(1)  # nothing computes on fakes: one thread leaves the other cores to other work
    if args.one:
        mode, length, path = args.one
        result = measure_length(build(args.shape, args.device, env), mode, int(length), budget, args.device,
                                args.compiler, env)
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
        model = model or build(args.shape, args.device, env)
        if mode == "hf-checkpointing":
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        rows.append((mode, *search(lambda n: measure_length(model, mode, n, budget, args.device, args.compiler, env),
                                   args.start, args.granularity, args.time_limit)))
    text = report(rows, " ".join(["python benchmarks/longest_sequence.py", *sys.argv[1:]]), args, budget)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
