"""How many genetic generations pay off: best predicted peak, max batch at the budget and planning time per
genetic_nr_iter, and the convergence plot.

    python benchmarks/tune_genetic.py --model resnet50,bert-base --genetic-iters 0,1,2,5,10,20,50 \
        --out docs/genetic_tuning.md --plot docs/genetic_convergence.png

Takes every option of `sublinear tune` (same engine, meta device).
"""

import sys

from sublinear.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
