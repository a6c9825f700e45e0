"""Max batch at a memory budget: eager, hand-written torch checkpointing, sublinear's plans (the README's main job).

    python benchmarks/maxbatch.py --model resnet50,bert-base --memory-budget 11GiB --genetic-iters 0,20 \
        --time-limits 1.2,inf --out docs/maxbatch.md
    python benchmarks/maxbatch.py --model hf:BertForSequenceClassification,hf:GPT2LMHeadModel \
        --memory-budget 11GiB --genetic-iters 20 --time-limits 1.4,inf --out docs/maxbatch_hf.md

Takes every option of `sublinear maxbatch` (same engine); --device cuda measures on the GPU for real.
"""

import sys

from sublinear.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["maxbatch", *sys.argv[1:]]))
