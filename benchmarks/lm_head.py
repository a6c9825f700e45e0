"""The LM head and its loss, side by side: peak and step time of one causal-LM training step, per way of running it.

    python benchmarks/lm_head.py --batch 4 --vocabularies 32000 --out docs/lm_head.md

A Llama-shaped model (Hugging Face ``LlamaForCausalLM``, random-initialised: 2 layers, hidden 512, intermediate
1,376, 8 heads) over ``--batch`` sequences of 512 tokens with labels, at vocabularies of 32,000 and 128,256
(``--vocabularies``), its step (forward, loss, backward) on CPU in float32. The peak includes the parameters and
their gradients (the embedding and the head are vocabulary x 512 each); ``--device cuda`` runs it on the GPU, the
peak being CUDA's caching allocator's (``torch.cuda.max_memory_allocated``). Each mode runs in its own subprocess
(fresh allocator and inductor cache, ``--threads`` threads):

- ``eager``: ``model(input_ids=..., labels=...).loss.backward()``;
- ``torch.compile``: the same through ``torch.compile(model)``;
- ``auto-chunker``: ``torch.compile`` with inductor's ``auto_chunker.enable``;
- ``linear_cross_entropy``: the model's body, then ``F.linear_cross_entropy`` on its last hidden states with
  ``LinearCrossEntropyOptions()`` (torch's chunked head and loss, patched in by hand; eager);
- ``hf-checkpointing``: eager after ``model.gradient_checkpointing_enable()``;
- ``sublinear``: ``sublinear.apply(model)`` with the defaults (inductor; the head and its loss chunked);
- ``sublinear-unchunked``: the same with ``chunk_lm_heads=False``;
- ``sublinear-x1.1``: the defaults with ``max_time_ratio=1.1`` (less recompute in the layers).

Two steps warm up (capture, plan, compile); the third step's peak is the CPU allocator's count
(:func:`sublinear.measure_cpu_allocator`, gradients None before it) and the time is the median of steps 4-6 (4-8
on CUDA). For the sublinear modes the plan's predicted peak is reported beside it; the first step's loss and
gradient norm show that every mode trains the same model alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODES = ("eager", "torch.compile", "auto-chunker", "linear_cross_entropy", "hf-checkpointing", "sublinear",
         "sublinear-unchunked", "sublinear-x1.1")
VOCABULARIES = (32000, 128256)
TOKENS = 512


def build(vocabulary: int, batch: int, device: str = "cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocabulary, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=TOKENS)
    model = LlamaForCausalLM(config).train().to(device)
    ids = torch.randint(0, vocabulary, (batch, TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def _runner(mode: str, model, ids):
    """The step of ``mode``: a function of no arguments running forward, loss and backward."""
    import torch.nn.functional as F

    if mode == "linear_cross_entropy":
        from torch.nn import LinearCrossEntropyOptions
        options = LinearCrossEntropyOptions()
        labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100, device=ids.device)], dim=1).reshape(-1)

        def step():
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = F.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels,
                                          ignore_index=-100, options=options)
            loss.backward()
            return loss
        return step, model
    run = model
    if mode in ("torch.compile", "auto-chunker"):
        import torch._inductor.config as inductor_config
        inductor_config.auto_chunker.enable = mode == "auto-chunker"
        run = torch.compile(model)
    elif mode == "hf-checkpointing":
        model.gradient_checkpointing_enable()
    elif mode.startswith("sublinear"):
        import sublinear
        run = sublinear.apply(model, sublinear.SublinearMemoryConfig(
            cache_dir="", chunk_lm_heads=False if mode == "sublinear-unchunked" else None,
            max_time_ratio=1.1 if mode == "sublinear-x1.1" else 1.35))

    def step():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return step, run


def _peak_bytes(step, model, device: str) -> int:
    """The step's peak: the CPU allocator's count, or CUDA's caching allocator's (parameters and inputs included)."""
    import sublinear

    measure = sublinear.measure_cpu_allocator if device == "cpu" else sublinear.measure
    return measure(lambda _m: step(), model).peak_bytes


def _gradient_norm(model) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                       if p.grad is not None])))


def run_one(mode: str, vocabulary: int, batch: int, threads: int, device: str = "cpu") -> dict:
    """One mode at one vocabulary, in this process."""
    torch.set_num_threads(threads)
    model, ids = build(vocabulary, batch, device)
    step, run = _runner(mode, model, ids)
    result = {"mode": mode, "vocabulary": vocabulary}
    started = time.perf_counter()
    result["loss"] = float(step().detach())
    result["gradient_norm"] = _gradient_norm(model)
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    result["warmup_s"] = time.perf_counter() - started
    result["peak_bytes"] = _peak_bytes(step, model, device)
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(5 if device == "cuda" else 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    result["step_s"] = statistics.median(times)
    plan = model.__dict__.get("sublinear_plan")
    if plan is not None:
        result["predicted_bytes"] = plan.predicted_peak_bytes
        result["heads"] = [h for g in plan.graphs for h in g.lm_heads]
    return result


def _machine(device: str, threads: int) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}"
    return f"{platform.machine()} CPU, {threads} thread(s) per run"


def report(results: list[dict], command: str, threads: int, batch: int, device: str = "cpu") -> str:
    from sublinear.core.units import format_bytes

    lines = ["# The LM head and its loss", "", __doc__.split("\n\n", 2)[2].strip(), "",
             f"Command: `{command}`", "",
             f"{_machine(device, threads)}, torch {torch.__version__}, float32, {batch} x {TOKENS} tokens.", ""]
    for vocabulary in dict.fromkeys(r["vocabulary"] for r in results):
        rows = [r for r in results if r["vocabulary"] == vocabulary]
        compiled = next((r for r in rows if r["mode"] == "torch.compile" and "error" not in r), None)
        lines += [f"## Vocabulary {vocabulary:,}", "",
                  "| mode | peak | step s | step vs torch.compile | predicted peak | first loss | gradient norm |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['mode']} | failed: {r['error'][:120]} | | | | | |")
                continue
            ratio = f"x{r['step_s'] / compiled['step_s']:.2f}" if compiled else "–"
            predicted = format_bytes(r["predicted_bytes"]) if "predicted_bytes" in r else "–"
            lines.append(f"| {r['mode']} | {format_bytes(r['peak_bytes'])} | {r['step_s']:.3f} | {ratio} | "
                         f"{predicted} | {r['loss']:.6f} | {r['gradient_norm']:.6f} |")
        heads = next((r["heads"] for r in rows if r["mode"] == "sublinear" and r.get("heads")), None)
        if heads:
            lines += ["", f"sublinear's plan: {'; '.join(heads)}."]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--vocabularies", default=",".join(map(str, VOCABULARIES)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="sequences of 512 tokens per step")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--one", nargs=3, metavar=("MODE", "VOCABULARY", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, vocabulary, path = args.one
        try:
            result = run_one(mode, int(vocabulary), args.batch, args.threads, args.device)
        except Exception as exc:  # noqa: BLE001 - every failure is reported in its row
            result = {"mode": mode, "vocabulary": int(vocabulary), "error": f"{type(exc).__name__}: {exc}"}
        with open(path, "w") as f:
            json.dump(result, f)
        return
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for vocabulary in map(int, args.vocabularies.split(",")):
            for mode in args.modes.split(","):
                path = os.path.join(folder, f"{mode}-{vocabulary}.json")
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, f"inductor-{mode}-{vocabulary}")}
                subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--batch", str(args.batch),
                                "--device", args.device, "--one", mode, str(vocabulary), path],
                               env=env, check=False, timeout=1800)
                result = json.load(open(path)) if os.path.exists(path) else \
                    {"mode": mode, "vocabulary": vocabulary, "error": "the run died"}
                print(json.dumps(result), flush=True)
                results.append(result)
    command = "python benchmarks/lm_head.py" + "".join(f" {a}" for a in sys.argv[1:])
    text = report(results, command, args.threads, args.batch, args.device)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
