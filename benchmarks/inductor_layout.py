"""What inductor's layout optimization costs a convolution net's step on the CPU: peak and step time of eager,
``torch.compile`` and sublinear (inductor, no budget: the lowest peak within the time cap), with
``torch._inductor.config.layout_optimization`` on (inductor's default) and off; for sublinear, "on" and "off" set
its ``channels_last`` to True and False, and "auto" leaves it None (the layout of the lower predicted peak).

    for m in timm_resnet resnet50; do for mode in eager torch.compile sublinear; do for layout in on off; do
        python benchmarks/inductor_layout.py --model $m --mode $mode --layout $layout; done; done; done
    python benchmarks/inductor_layout.py --size large --model timm_convnext --mode sublinear --layout auto

With mkldnn, inductor lays every convolution of a CPU graph out channels-last: forward makes a channels-last copy
of each convolution's weight and of its activations, and keeps the copies it saves for backward. One model, mode
and setting per process (a fresh process, one thread); the models are those of ``benchmarks/compiled_memory.py``.
The peak is the CPU allocator's count of the fourth step (:func:`sublinear.measure_cpu_allocator`, gradients None
before it), the step time the median of five more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiled_memory  # noqa: E402

LAYOUTS = {"on": True, "off": False, "auto": None}  # --layout: sublinear's channels_last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="timm_resnet", choices=compiled_memory.MODELS)
    parser.add_argument("--mode", default="sublinear", choices=("eager", "torch.compile", "sublinear"))
    parser.add_argument("--layout", default="on", choices=tuple(LAYOUTS))
    parser.add_argument("--size", default="small", choices=("small", "large"), help="compiled_memory.py's sizes")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    import sublinear

    inductor_config.fallback_random = True
    inductor_config.layout_optimization = options.layout != "off"
    compiled_memory.SIZE = options.size
    model, args, kwargs, step = compiled_memory._build(options.model)
    channels_last = LAYOUTS[options.layout]
    run = {"eager": lambda: model, "torch.compile": lambda: torch.compile(model),
           "sublinear": lambda: sublinear.apply(model, sublinear.SublinearMemoryConfig(
               compiler="inductor", cache_dir="", min_memory_per_time=0, channels_last=channels_last))}[options.mode]()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        step(run, *args, **kwargs)
    model.zero_grad(set_to_none=True)
    peak = sublinear.measure_cpu_allocator(step, run, *args, **kwargs).peak_bytes
    seconds = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(run, *args, **kwargs)
        seconds.append(time.perf_counter() - start)
    predicted = (f", predicted {model.sublinear_plan.predicted_peak_bytes / 2**20:.2f} MiB"
                 if options.mode == "sublinear" else "")
    print(f"{options.model} | {options.mode} | layout optimization {options.layout} | peak "
          f"{peak / 2**20:.2f} MiB | step {statistics.median(seconds) * 1e3:.1f} ms{predicted}", flush=True)


if __name__ == "__main__":
    main()
