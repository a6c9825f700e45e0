"""Where the first training steps' time goes: ``torch.compile`` against sublinear compiled by inductor, one model of
benchmarks/third_party.py, cold caches, one thread, each mode in a fresh process.

    python benchmarks/startup.py --model bert
    python benchmarks/startup.py --model gpt2 --max-time-ratio 1.0   # a plan without recompute

Prints the first two steps' seconds, and for sublinear the seconds spent in each stage of the first: tracing the
joint graph to profile it, profiling, the plan search, and the compile (AOTAutograd's own trace and inductor's code
generation, the latter also on its own, and the compile's wait for inductor's vector instruction set probe, which runs
in the background from the first call); and the C++ modules inductor built (on CPU each kernel is one).
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _timed(owner, name: str, label: str, spent: dict) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started

    setattr(owner, name, timed)


def run(model_name: str, mode: str, max_time_ratio: float) -> None:
    """Two training steps of ``model_name`` in ``mode`` ("torch.compile" or "sublinear-inductor"), in this process."""
    import torch
    import torch._inductor.config as inductor_config

    sys.path.insert(0, str(Path(__file__).parent))
    import third_party

    torch.set_num_threads(1)
    inductor_config.fallback_random = True
    logging.getLogger("transformers").setLevel(logging.ERROR)
    spent: dict[str, float] = collections.defaultdict(float)
    torch.manual_seed(third_party.INIT_SEED)
    model, batches, loss_fn = third_party.MODELS[model_name][2]()
    model.train()
    if mode == "torch.compile":
        runnable = torch.compile(model)
    else:
        import torch._inductor.compile_fx as compile_fx

        import sublinear
        from sublinear.execute.compiled import CompiledGraph
        from sublinear.execute.compiled import executor as compiled_executor
        from sublinear.runtime import pipeline

        _timed(pipeline, "trace_joint", "joint graph traced to profile", spent)
        _timed(pipeline, "profile_compiled_step", "profile", spent)
        _timed(pipeline, "make_plan", "plan search", spent)
        _timed(CompiledGraph, "_compile", "compile (AOTAutograd's trace and inductor)", spent)
        _timed(compiled_executor, "wait_for_isa_probe", "compile's wait for inductor's vector ISA probe", spent)
        _timed(CompiledGraph, "memory_for", "compile check (the compiled code walked)", spent)
        _timed(compile_fx, "compile_fx_inner", "inductor's code generation alone", spent)
        config = sublinear.SublinearMemoryConfig(compiler="inductor", cache_dir="", max_time_ratio=max_time_ratio)
        runnable = sublinear.apply(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=third_party.LR)
    for step, (args, kwargs, extra) in enumerate(batches[:2]):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(runnable(*args, **kwargs), extra).backward()
        optimizer.step()
        print(f"{mode}: step {step + 1} {time.perf_counter() - started:.1f} s", flush=True)
    for label, seconds in spent.items():
        print(f"{mode}:   {label} {seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert", help="a model of benchmarks/third_party.py")
    parser.add_argument("--max-time-ratio", type=float, default=1.35)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a mode, run in this process
    options = parser.parse_args()
    if options.one:
        run(options.model, options.one, options.max_time_ratio)
        return
    for mode in ("torch.compile", "sublinear-inductor"):
        with tempfile.TemporaryDirectory(prefix="startup_") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            subprocess.run([sys.executable, __file__, "--model", options.model, "--one", mode,
                            "--max-time-ratio", str(options.max_time_ratio)], env=env, check=True)
            print(f"{mode}: {len(list(Path(cache).rglob('*.so')))} C++ modules built")


if __name__ == "__main__":
    main()
