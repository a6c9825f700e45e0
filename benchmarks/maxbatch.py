"""Max batch at a memory budget: eager, hand-written torch checkpointing, sublinear's plans (the README's main job).

    python benchmarks/maxbatch.py --model resnet50,bert-base --budget 11GiB --genetic-iters 0,20 \
        --flops-limits 1.20,1.34 --out docs/maxbatch.md
    python benchmarks/maxbatch.py --model resnet50 --autocast bf16 --genetic-iters 0,20 --out docs/maxbatch_amp.md

Takes every option of `sublinear maxbatch` (same engine); --device cuda measures on the GPU for real.
"""

import sys

from sublinear.cli import main

if __name__ == "__main__":
    sys.exit(main(["maxbatch", *sys.argv[1:]]))
