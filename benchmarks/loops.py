"""The two training loops of the README, run for real on this CPU, eager against sublinear: peak memory of a
training step (the CPU allocator's own count) and the median step time.

    python benchmarks/loops.py --out docs/loops.md

- Hugging Face fine-tuning: ``transformers.Trainer`` on BertForSequenceClassification (BERT-base config, random
  weights, sequence 256, batch 8) with ``sublinear.apply(model)``.
- A torchvision-style CNN loop: the zoo's ResNet-50 at 224x224, batch 16, SGD on cross-entropy, with
  ``sublinear.compile``.

Both use the default config: on CPU no memory budget, so the plan is the lowest predicted peak within
``max_time_ratio`` 1.35, with op costs measured on this CPU.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import sublinear
from sublinear.models import get_model


def hf_loop(steps: int, batch: int, seq: int, planned: bool, tmp: str) -> tuple[list[float], int, str]:
    """Step times of a Trainer run, the allocator's peak of one more training step, and the plan."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig()).train()
    if planned:
        sublinear.apply(model)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 30522, (seq,), generator=g),
             "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": torch.randint(0, 2, (), generator=g)} for _ in range(batch * (steps + 1))]
    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            times.append(time.perf_counter() - self.started)

    args = transformers.TrainingArguments(output_dir=tmp, max_steps=steps + 1, per_device_train_batch_size=batch,
                                          report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimes()])
    trainer.train()
    inputs = transformers.default_data_collator(data[:batch])

    def step(m):
        m(**inputs).loss.backward()

    model.zero_grad(set_to_none=True)
    peak = sublinear.measure_cpu_allocator(step, model).peak_bytes
    plan = str(model.sublinear_plan) if planned else "eager"
    return times[1:], peak, plan  # the first step captures and plans


def cnn_loop(steps: int, batch: int, planned: bool) -> tuple[list[float], int, str]:
    spec = get_model("resnet50")
    torch.manual_seed(0)
    model = spec.build().train()
    (x,), _ = spec.example_inputs(batch)
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(0))
    net = sublinear.compile(model, (x,)) if planned else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)

    def step(m):
        F.cross_entropy(m(x), y).backward()

    model.zero_grad(set_to_none=True)
    peak = sublinear.measure_cpu_allocator(step, net).peak_bytes
    return times[1:], peak, str(net.sublinear_plan) if planned else "eager"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    import tempfile

    command = "python benchmarks/loops.py " + " ".join(sys.argv[1:])
    lines = [f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}. "
             f"Command: `{command}`", "",
             "| loop | strategy | peak of a training step (MiB) | × eager | median step (s) | × eager |",
             "|---|---|---|---|---|---|"]
    plans = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"Hugging Face Trainer, BERT-base, seq 256, batch 8":
                lambda planned: hf_loop(options.steps, 8, 256, planned, tmp),
                "CNN loop, ResNet-50 @224, batch 16": lambda planned: cnn_loop(options.steps, 16, planned)}
        for label, run in runs.items():
            eager_times, eager_peak, _ = run(False)
            times, peak, plan = run(True)
            plans.append(f"{label}: {plan}")
            for strategy, t, p in (("eager", eager_times, eager_peak), ("sublinear", times, peak)):
                ratio = statistics.median(t) / statistics.median(eager_times)
                lines.append(f"| {label} | {strategy} | {p / 2**20:,.0f} | {p / eager_peak:.2f} | "
                             f"{statistics.median(t):.2f} | {ratio:.2f} |")
                print(lines[-1], flush=True)
    lines += ["", *(f"- {p}" for p in plans)]
    if options.out:
        with open(options.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
