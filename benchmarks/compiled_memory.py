"""The compiled step's memory, predicted before compiling against the CPU allocator, and budget sweeps.

    python benchmarks/compiled_memory.py --jobs 2 --out docs/compiled_memory.md
    python benchmarks/compiled_memory.py --device cuda --jobs 8 --out docs/compiled_memory_cuda.md
    python benchmarks/compiled_memory.py --rng inductor --jobs 2   # torch.compile's own random numbers
    python benchmarks/compiled_memory.py --size large --jobs 2     # the set at 5-40 MiB a step (large_models.py)

For each model (the third-party set of ``benchmarks/third_party.py``, random-initialised from small configs, the
zoo's ResNet-50, and two causal LMs whose vocabulary-sized head decides the peak), in its own subprocess with an
empty inductor cache and one thread:

1. eager's peak: one plain step (forward, loss, backward; gradients None before it) after a first one, the CPU
   allocator's count (:func:`sublinear.measure_cpu_allocator`);
2. the lowest peak any plan reaches: ``memory_budget=1`` raises :class:`sublinear.BudgetError` while planning, before
   anything compiles, with the smallest predicted peak;
3. the points: no budget, then budgets at fractions 0.02, 0.35 and 0.7 of the way from that lowest peak to eager's
   (or to the no-budget plan's predicted peak, where that is higher: tiny models whose compiled step holds more).
   Each point applies sublinear (inductor, ``cache_dir=""``) to a fresh copy of the model (the same initial weights),
   runs two steps (capture, plan, compile) and measures the third with the allocator. A step is
   ``loss_fn(model(*args, **kwargs)).backward()``: the model's output object is dropped before backward runs.
   On ``--device cuda`` the model and its inputs move to the GPU, and the measured peak is the caching allocator's
   (``torch.cuda.max_memory_allocated``, read by :func:`sublinear.measure`) less what was allocated before the step
   plus the model's parameters, buffers and inputs, as on CPU.
   "before compiling" is the step's peak the plan was chosen with (the largest over graphs of
   ``GraphPlan.predicted_before_compile_bytes``); "after the compile check" is the prediction once the compiled code
   was walked statement by statement and the profile taught what it held; "compiles" counts the plans whose
   kernels the first call built (1 + the plans compiled after the first was found above its budget, compiled or
   read from the wrapper code inductor generates without building its kernels); "wrapper code read" counts the
   plans judged by that code (a faster plan predicted less than 2 % above the budget, a first plan predicted less
   than 2 % under it, then the alternates).

The report checks the targets of the compiled memory model: the prediction before compiling within 2 % (or 256 KiB)
of the allocator, every measured peak at or below its budget, and the measured peak never rising with the budget.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import large_models  # noqa: E402
import third_party  # noqa: E402

FRACTIONS = (0.02, 0.35, 0.7)
MODELS = ("custom", "bert", "gpt2", "llama", "t5", "llama_lora", "mixtral", "mamba", "timm_vit", "timm_convnext",
          "timm_resnet", "unet", "autoencoder_kl", "resnet50", "gpt2_head", "llama_head")
TOLERANCE, FLOOR = 0.02, 256 * 1024


DEVICE = "cpu"  # where the subprocess runs its model (--device)
RNG = "aten"  # aten: inductor's fallback_random (dropout draws as eager's); inductor: its own random numbers (--rng)
SIZE = "small"  # small: third_party.py's configs; large: large_models.py's (--size)
KEPT_BY_FIRST_STEP = 0  # CUDA: bytes the first eager step left allocated (the cuBLAS workspaces), measured in run_one


def _head_model(name: str):
    """A causal LM whose vocabulary-sized values decide the step's peak (vocabulary 8,000, width 128, 4 layers,
    4x128 tokens: each logits-sized buffer is 15.6 MiB), with HF's loss and the logits returned."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2_head":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_embd=128, n_layer=4, n_head=4, n_positions=128))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=128))
    ids = third_party._ids(torch.Generator().manual_seed(0), 4, 128, vocab=8000)
    return model, (), {"input_ids": ids, "labels": ids.clone()}, None, third_party._hf_loss


HEAD_TITLES = {"gpt2_head": "GPT-2, vocabulary 8,000 (width 128, 4 layers, 4×128 tokens)",
               "llama_head": "Llama, vocabulary 8,000 (width 128, 4 layers, 4×128 tokens)"}


def _build(name: str):
    """(model, args, kwargs, step) for ``name``, on :data:`DEVICE`: ``step(module, *args, **kwargs)`` is one training
    step of ``module`` (the model, or what sublinear made of it)."""
    from torch.utils._pytree import tree_map

    torch.manual_seed(third_party.INIT_SEED)
    if name == "resnet50":
        from sublinear.models import get_model
        from sublinear.training import default_loss

        model = get_model("resnet50").build()
        x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        args, kwargs, extra, loss_fn = (x,), {}, None, lambda out, extra: default_loss(out)
    elif name in HEAD_TITLES:
        model, args, kwargs, extra, loss_fn = _head_model(name)
    else:
        builder = large_models.BUILDERS[name] if SIZE == "large" else third_party.MODELS[name][2]
        model, batches, loss_fn = builder()
        args, kwargs, extra = batches[0]
    args, kwargs, extra = tree_map(lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v,
                                   (args, kwargs, extra))

    def step(module, *args, **kwargs) -> None:
        loss_fn(module(*args, **kwargs), extra).backward()

    return model.to(DEVICE).train(), args, kwargs, step


def _measured_peak(step, module, *args, **kwargs) -> int:
    """One step's peak: the allocator's count of what the step allocates, plus the parameters, buffers and inputs
    (on CUDA, plus the cuBLAS workspaces the first step left, which every step holds; what earlier points' compiled
    code still holds is not this step's)."""
    import sublinear

    if DEVICE == "cpu":
        return sublinear.measure_cpu_allocator(step, module, *args, **kwargs).peak_bytes
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    report = sublinear.measure(step, module, *args, **kwargs)
    return (report.peak_bytes - report.baseline_bytes + report.parameter_bytes + report.buffer_bytes
            + report.input_bytes + KEPT_BY_FIRST_STEP)


class _Replans(logging.Handler):
    """Counts the plans compiled after the first plan came out above its budget (built, or judged by its wrapper code
    without building its kernels), the first plans not built, and the wrapper codes read without building."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled_again = self.unbuilt = self.wrapper_reads = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.compiled_again += "compiling that plan" in message
        self.unbuilt += "before its kernels are built" in message
        self.wrapper_reads += "as inductor's wrapper code for it reads" in message


def _point(name: str, budget: int | None) -> dict:
    import sublinear

    model, args, kwargs, step = _build(name)
    replans = _Replans()
    logging.getLogger("sublinear").addHandler(replans)
    logging.getLogger("sublinear").setLevel(logging.INFO)
    config = sublinear.SublinearMemoryConfig(compiler="inductor", cache_dir="", memory_budget=budget,
                                             min_memory_per_time=0)  # no budget: the lowest peak within the cap
    run = sublinear.apply(model, config)
    res = {"budget": budget, "error": None}
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step(run, *args, **kwargs)
        model.zero_grad(set_to_none=True)
        res["measured"] = _measured_peak(step, run, *args, **kwargs)
        plan = model.sublinear_plan
        res["before"] = max(g.predicted_before_compile_bytes or g.predicted_peak_bytes for g in plan.graphs)
        res["compiled"] = plan.predicted_peak_bytes
        res["walked"] = max(g.compiled_peak_bytes or 0 for g in plan.graphs)
        res["graphs"] = len(plan.graphs)
        res["blocks"] = sum(g.num_blocks for g in plan.graphs)
    except sublinear.BudgetError as exc:
        res["error"] = str(exc).splitlines()[0][:240]
    finally:
        logging.getLogger("sublinear").removeHandler(replans)
    res["compiles"] = 1 + replans.compiled_again - replans.unbuilt
    res["wrapper_reads"] = replans.wrapper_reads
    torch._dynamo.reset()
    return res


def _lowest(name: str) -> int:
    """The lowest peak the search reaches: what a budget of one byte is refused with. Where graph breaks split the
    step, a refusal before the first call ends (``later_graphs_unknown``) names a graph's lowest peak beside the
    graphs before it alone: the step's is then what a budget at that figure is refused with once the call's graphs
    are planned for each other (the figure itself where that budget is met), raised again while refusals still
    come before the later graphs are known."""
    import sublinear

    model, args, kwargs, _ = _build(name)
    split = torch._dynamo.explain(model)(*args, **kwargs).graph_count > 1
    torch._dynamo.reset()
    budget = 1
    for _attempt in range(8):
        model, args, kwargs, step = _build(name)
        run = sublinear.apply(model, sublinear.SublinearMemoryConfig(compiler="inductor", cache_dir="",
                                                                     memory_budget=budget))
        try:
            for _call in range(3):
                step(run, *args, **kwargs)
        except sublinear.BudgetError as exc:
            if not (split and exc.later_graphs_unknown):
                return int(exc.smallest)
            budget = max(budget + 1, int(exc.smallest))
            continue
        finally:
            torch._dynamo.reset()
        if budget == 1:
            raise RuntimeError(f"{name}: a budget of one byte was met")
        return budget
    raise RuntimeError(f"{name}: no lowest peak found")


def run_one(name: str, path: str) -> None:
    torch.set_num_threads(1)
    for noisy in ("transformers", "diffusers", "timm", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = RNG == "aten"
    res: dict = {"model": name, "error": None, "points": []}
    try:
        model, args, kwargs, step = _build(name)
        before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        step(model, *args, **kwargs)  # the cuBLAS workspaces made at first use stay allocated: every step holds them
        model.zero_grad(set_to_none=True)
        if DEVICE == "cuda":
            global KEPT_BY_FIRST_STEP
            KEPT_BY_FIRST_STEP = torch.cuda.memory_allocated() - before
        res["eager"] = _measured_peak(step, model, *args, **kwargs)
        res["lowest"] = low = _lowest(name)
        res["points"].append(_point(name, None))
        torch.save(res, path)  # each point as it is measured: a run cut off at its time limit keeps what it has
        high = max(res["eager"], res["points"][0].get("before", 0))
        for f in FRACTIONS:
            res["points"].append(_point(name, int(low + f * (high - low))))
            torch.save(res, path)
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        res["traceback"] = traceback.format_exc()
    torch.save(res, path)


def _subprocess(name: str, folder: str, timeout: float, flags: list[str]) -> dict:
    path = os.path.join(folder, f"{name}.pt")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix=f"inductor-{name}-", dir=folder),
           "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    with open(os.path.join(folder, f"{name}.log"), "w") as log:
        try:
            subprocess.run([sys.executable, __file__, *flags, "--one", name, path],
                           stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False)
        except subprocess.TimeoutExpired:
            timed_out = f"timed out after {timeout:.0f} s"
        else:
            timed_out = None
    result = (torch.load(path, weights_only=False) if os.path.exists(path) else
              {"model": name, "error": "no result", "points": []})
    result["error"] = timed_out or result["error"]
    if result["error"]:  # the log dies with the folder: its end is printed
        tail = Path(log.name).read_text(errors="replace").splitlines()[-25:]
        print(f"== {name}: {result['error']}\n" + "\n".join(tail), flush=True)
    return result


def _mib(b: int | None) -> str:
    return "–" if b is None else f"{b / 2**20:.3f}"


def _within(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= max(TOLERANCE * measured, FLOOR)


def _rows(res: dict) -> tuple[list[str], dict]:
    title = HEAD_TITLES.get(res["model"]) or third_party.MODELS.get(res["model"], ("ResNet-50 (zoo, 4×3×64×64)",))[0]
    checks = {"predicted": 0, "predicted_ok": 0, "budgets": 0, "met": 0, "one_compile": 0, "monotone": True,
              "refused_fitting": False}
    if res.get("error") and not res["points"]:
        return [f"| {title} | – | – | – | – | – | – | – | {res['error']} |"], checks
    rows, last, lowest_met = [], None, None
    for p in res["points"]:
        budget = "none" if p["budget"] is None else _mib(p["budget"])
        if p["error"]:
            fits = p["budget"] is not None and lowest_met is not None and lowest_met <= p["budget"]
            checks["refused_fitting"] |= fits
            known = f"**refused, though a smaller budget's plan measures {_mib(lowest_met)}**: " if fits else ""
            rows.append(f"| {title} | {_mib(res['eager'])} | {budget} | – | – | – | – | {p['compiles']} | "
                        f"{known}{p['error']} |")
            continue
        error = (p["before"] - p["measured"]) / p["measured"]
        checks["predicted"] += 1
        checks["predicted_ok"] += _within(p["before"], p["measured"])
        notes = []
        if p["budget"] is not None:
            checks["budgets"] += 1
            met = p["measured"] <= p["budget"]
            checks["met"] += met
            if met:
                lowest_met = p["measured"] if lowest_met is None else min(lowest_met, p["measured"])
            checks["one_compile"] += p["compiles"] == 1
            notes.append("met" if met else f"**over by {(p['measured'] - p['budget']) / 2**10:.0f} KiB**")
            if p.get("wrapper_reads"):
                notes.append(f"wrapper code read {p['wrapper_reads']}x")
            if last is not None and p["measured"] < last:
                checks["monotone"] = False
                notes.append("**below the smaller budget's peak**")
            last = p["measured"]
        rows.append(f"| {title} | {_mib(res['eager'])} | {budget} | {_mib(p['before'])} | {_mib(p['compiled'])} | "
                    f"{_mib(p['measured'])} | {error:+.1%} | {p['compiles']} | {'; '.join(notes)} |")
    return rows, checks


def report(results: list[dict], seconds: float, command: str, device: str, rng: str = "aten",
           size: str = "small") -> str:
    where = (f"{platform.machine()} CPU, {os.cpu_count()} cores, 1 thread per run" if device == "cpu" else
             f"{torch.cuda.get_device_name(device)} (the caching allocator's peak), {os.cpu_count()} CPU cores")
    lines = ["# Compiled step memory: predicted before compiling, and budgets", "",
             f"Command: `{command}`", "",
             f"{where}, torch {torch.__version__}. "
             f"Total run time {seconds / 60:.1f} min. Sizes in MiB (the allocator's peak of a whole step: parameters, "
             "inputs, activations and gradients). Budgets: no budget, then 0.02, 0.35 and 0.7 of the way from the "
             "lowest predicted peak any plan reaches (what `memory_budget=1` reports) to eager's measured peak (or the "
             "no-budget plan's predicted peak, when higher). "
             + ("The third-party models at large_models.py's sizes (width 128, 4x128 tokens, 64x64 images). "
                if size == "large" else "") +
             "Error: before compiling against measured. Random numbers: "
             + ("aten's (inductor's `fallback_random`)." if rng == "aten" else
                "inductor's own (torch.compile's default, `fallback_random` off)."), "",
             "| model | eager | budget | predicted before compiling | after the compile check | measured | error "
             "| compiles | budget |", "|---|---|---|---|---|---|---|---|---|"]
    totals = {"predicted": 0, "predicted_ok": 0, "budgets": 0, "met": 0, "one_compile": 0}
    non_monotone, refused_fitting = [], []
    for res in results:
        rows, checks = _rows(res)
        lines += rows
        for key in totals:
            totals[key] += checks[key]
        if not checks["monotone"]:
            non_monotone.append(res["model"])
        if checks["refused_fitting"]:
            refused_fitting.append(res["model"])
    lines += ["", "## Summary", "",
              f"- Predicted before compiling within 2 % (or 256 KiB) of the allocator: {totals['predicted_ok']} of "
              f"{totals['predicted']} points.",
              f"- Budgets met: {totals['met']} of {totals['budgets']}; met with one compile: {totals['one_compile']}.",
              "- Measured peak falling as the budget rises (a larger budget planned to a lower peak): "
              f"{', '.join(non_monotone) or 'none'}.",
              "- A budget refused where a smaller budget's plan, compiled, measures within it: "
              f"{', '.join(refused_fitting) or 'none'}."]
    failed = [r for r in results if r.get("error")]
    if failed:
        lines += ["", "## Failures", ""] + [f"- {r['model']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rng", choices=("aten", "inductor"), default="aten",
                        help="aten: inductor's fallback_random (the default here); inductor: its own random numbers")
    parser.add_argument("--size", choices=("small", "large"), default="small",
                        help="large: the third-party models at large_models.py's sizes")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    global DEVICE, RNG, SIZE
    DEVICE, RNG, SIZE = options.device, options.rng, options.size
    if options.one:
        run_one(*options.one)
        return
    start = time.perf_counter()
    command = f"python benchmarks/compiled_memory.py {' '.join(sys.argv[1:])}"
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(options.jobs) as pool:
        flags = ["--device", options.device, "--rng", options.rng, "--size", options.size]
        futures = {pool.submit(_subprocess, name, folder, options.timeout, flags): name for name in options.models}
        for future in as_completed(futures):  # the report so far, rewritten as each model finishes
            results[futures[future]] = future.result()
            text = report([results[m] for m in options.models if m in results], time.perf_counter() - start,
                          command, options.device, options.rng, options.size)
            if options.out:
                Path(options.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
