"""The eager executor's measured step time against the plan's predicted one, on Hugging Face models on CPU.

Per model (random weights, training mode, SGD, one thread): the step time of eager PyTorch, of the TorchDynamo graph
run eagerly (``torch.compile(backend="eager")``: what capture alone costs or saves), and of sublinear's eager executor
under its default plan (no budget: the lowest predicted peak within x1.35). The measured ratio is sublinear's step
over eager's; the predicted ratio is the plan's. Medians of 40 steps after 10 warm-up steps.

Sizes: the tests' two-layer models (width 32, sequence 12, batch 3: every op takes microseconds) and the same models
at width 256, sequence 128, batch 8.

    python benchmarks/executor_overhead.py --out docs/executor_overhead.md
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import sublinear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import PLAIN  # noqa: E402
from test_hf import tiny_inputs, tiny_model  # noqa: E402

CONFIG = dataclasses.replace(PLAIN, compiler="eager", max_time_ratio=1.35)


def wide_model(family: str):
    """``family`` at width 256 (4 heads), two layers, and its inputs at sequence 128, batch 8."""
    T = transformers
    common = dict(num_hidden_layers=2, num_attention_heads=4)
    if family == "bert":
        model = T.BertForSequenceClassification._from_config(
            T.BertConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, max_position_embeddings=128,
                         **common), attn_implementation="eager")
    elif family == "gpt2":
        model = T.GPT2LMHeadModel._from_config(T.GPT2Config(vocab_size=1000, n_embd=256, n_layer=2, n_head=4,
                                                            n_positions=128), attn_implementation="eager")
    else:
        model = T.T5ForConditionalGeneration._from_config(
            T.T5Config(vocab_size=1000, d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_heads=4,
                       decoder_start_token_id=0), attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (8, 128), generator=g)
    labels = {"bert": torch.randint(0, 2, (8,), generator=g), "gpt2": ids,
              "t5": torch.randint(1, 1000, (8, 32), generator=g)}[family]
    return model.train(), dict(input_ids=ids, labels=labels)


def step_time(model, inputs: dict, steps: int = 40, warmup: int = 10) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[warmup:])


def measure(family: str, size: str) -> dict:
    torch.manual_seed(0)
    if size == "tiny":
        base, kind = tiny_model(family, "eager")
        base.train()
        inputs = tiny_inputs(kind)
    else:
        base, inputs = wide_model(family)
    eager = step_time(copy.deepcopy(base), inputs)
    dynamo = step_time(torch.compile(copy.deepcopy(base), backend="eager"), inputs)
    planned = sublinear.apply(copy.deepcopy(base), CONFIG)
    ours = step_time(planned, inputs)
    plan = planned.sublinear_plan
    return dict(model=family, size=size, eager=eager, dynamo=dynamo, ours=ours, predicted=plan.time_ratio,
                blocks=plan.num_blocks)


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
             f"thread(s). Command: `{command}`", "",
             "| model | size | eager step (ms) | Dynamo graph, eager backend (ms) | sublinear eager executor (ms) | "
             "blocks | predicted ratio | measured ratio | measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = r["ours"] / r["eager"]
        lines.append(f"| {r['model']} | {r['size']} | {r['eager'] * 1e3:.2f} | {r['dynamo'] * 1e3:.2f} | "
                     f"{r['ours'] * 1e3:.2f} | {r['blocks']} | x{r['predicted']:.3f} | x{measured:.3f} | "
                     f"{measured / r['predicted']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "wide"], choices=["tiny", "wide"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(family, size) for size in args.sizes for family in ("bert", "gpt2", "t5")]
    text = markdown(rows, "python benchmarks/executor_overhead.py --out docs/executor_overhead.md")
    print(text)
    if args.out:
        Path(args.out).write_text("# Eager executor: measured against predicted step time\n\n" + text)


if __name__ == "__main__":
    main()
