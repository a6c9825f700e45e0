"""Training over changing shapes: how many plans, compiles and seconds a loop whose batches change shape costs.

Loops (CPU, random weights, SGD):
- a Hugging Face BertForSequenceClassification (2 layers, width 32) over 20 steps at 10 sequence lengths between 9
  and 64 (dynamic padding), batch 4;
- the tests' TinyTransformer over 7 (batch, length) shapes;
- the same BERT loop with ``max_sizes={"input_ids": (4, 64)}``, planned for every shape at the first call.

Each under sublinear's inductor executor and its eager executor: the number of searches (plans searched, not
reused), joint-graph traces and inductor compiles in the whole loop and after the first two steps; the steps after
the first two as they first run, the same steps run again (warm), and eager's.

    python benchmarks/dynamic_shapes.py --out docs/dynamic_shapes.md
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import sublinear
import sublinear.runtime.pipeline as runtime
from sublinear.execute.compiled import CompiledGraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_hf import dynamic_padding, timed_steps  # noqa: E402
from test_shapes import SHAPES, TinyTransformer, token_batches  # noqa: E402

CONFIG = sublinear.SublinearMemoryConfig(memory_budget=None, cache_dir="")


class Counts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.searches = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("sublinear: planned graph"):
            self.searches += 1


def bert_loop():
    model, batches = dynamic_padding()
    return model, batches, lambda m, b: m(**b).loss


def transformer_loop():
    torch.manual_seed(0)
    return TinyTransformer(), [dict(ids=ids) for ids in token_batches(SHAPES)], lambda m, b: m(**b)


def run(name: str, loop, compiler: str, max_sizes=None) -> dict:
    base, batches, loss_of = loop()
    config = dataclasses.replace(CONFIG, compiler=compiler, max_sizes=max_sizes)
    model = sublinear.apply(copy.deepcopy(base), config)
    counts = Counts()
    logging.getLogger("sublinear").addHandler(counts)
    logging.getLogger("sublinear").setLevel(logging.INFO)
    work = {"trace": 0, "compile": 0}
    real_trace, real_compile = runtime.trace_joint, CompiledGraph._compile

    def trace(*a, **k):
        work["trace"] += 1
        return real_trace(*a, **k)

    def compile_(*a, **k):
        work["compile"] += 1
        return real_compile(*a, **k)

    runtime.trace_joint, CompiledGraph._compile = trace, compile_
    try:
        started = time.perf_counter()
        first_two = timed_steps(model, batches[:2], loss_of)
        early = (counts.searches, dict(work))
        first = timed_steps(model, batches[2:], loss_of)
        total = time.perf_counter() - started
        again = timed_steps(model, batches[2:], loss_of, repeats=3)
    finally:
        runtime.trace_joint, CompiledGraph._compile = real_trace, real_compile
        logging.getLogger("sublinear").removeHandler(counts)
    eager = timed_steps(copy.deepcopy(base), batches[2:], loss_of, repeats=3)
    return dict(name=name, compiler=compiler, steps=len(batches), searches=counts.searches,
                later_searches=counts.searches - early[0], traces=work["trace"],
                later_traces=work["trace"] - early[1]["trace"], compiles=work["compile"],
                later_compiles=work["compile"] - early[1]["compile"], first_two=sum(first_two), total=total,
                first=first, again=again, eager=eager, plan=str(model.sublinear_plan).splitlines()[0])


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"{torch.__version__}, {torch.get_num_threads()} threads. Command: `{command}`", "",
             "| loop | executor | steps | searches (after step 2) | joint traces (after) | inductor compiles (after) "
             "| steps 1-2 (s) | later steps, first run: median / sum (ms) | same, warm | eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def ms(times):
            return f"{statistics.median(times) * 1e3:.1f} / {sum(times) * 1e3:.0f}"
        lines.append(f"| {r['name']} | {r['compiler']} | {r['steps']} | {r['searches']} ({r['later_searches']}) | "
                     f"{r['traces']} ({r['later_traces']}) | {r['compiles']} ({r['later_compiles']}) | "
                     f"{r['first_two']:.1f} | {ms(r['first'])} | {ms(r['again'])} | {ms(r['eager'])} |")
    lines += ["", "Plans after the loop:", ""]
    lines += [f"- {r['name']}, {r['compiler']}: {r['plan']}" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for compiler in ("inductor", "eager"):
        rows.append(run("BERT, 10 lengths in 20 steps", bert_loop, compiler))
        rows.append(run("TinyTransformer, 7 (batch, length) shapes", transformer_loop, compiler))
        rows.append(run("BERT, max_sizes={'input_ids': (4, 64)}", bert_loop, compiler, {"input_ids": (4, 64)}))
    text = markdown(rows, "python benchmarks/dynamic_shapes.py --out docs/dynamic_shapes.md")
    print(text)
    if args.out:
        Path(args.out).write_text("# Changing shapes\n\n" + text)


if __name__ == "__main__":
    main()
