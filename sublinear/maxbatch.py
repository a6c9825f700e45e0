"""Max batch size under a memory budget, for eager, hand-written checkpointing and sublinear plans.

On ``meta`` every candidate batch is run once under :func:`sublinear.measure` (no RAM is used, any batch size
works). With ``autocast`` the model holds fake CPU tensors instead (autocast dispatches on the device, and meta
tensors have none), equally free. On ``cuda`` every candidate really runs: the budget is enforced with
``torch.cuda.set_per_process_memory_fraction`` and a batch fits when the step finishes without an out-of-memory
error; ``torch.cuda.max_memory_allocated`` gives its peak.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from .api import compile as sublinear_compile
from .baselines import BASELINES
from .config import SublinearMemoryConfig
from .measurement import measure
from .models import ModelSpec
from .profiler import default_loss

__all__ = ["StrategyResult", "compare", "largest_fitting"]

log = logging.getLogger("sublinear.maxbatch")


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    max_batch: int
    peak_bytes: int  # measured at max_batch
    flops_ratio: float  # step FLOPs at max_batch relative to eager's at the same batch
    planning_seconds: float | None  # sublinear only: capture + profile + plan at max_batch
    predicted_peak_bytes: int | None  # sublinear only
    device: str


def largest_fitting(fits: Callable[[int], bool], guess: int = 1, limit: int = 1 << 16) -> int:
    """Largest batch ``b`` in 1..limit with ``fits(b)``, assuming fitting is monotone in ``b``; 0 if none fits."""
    guess = max(1, min(guess, limit))
    if fits(guess):
        lo, step = guess, max(1, guess // 16)
        hi = lo + step
        while hi <= limit and fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit + 1)
    else:
        hi, step = guess, max(1, guess // 16)
        lo = hi - step
        while lo >= 1 and not fits(lo):
            hi, step = lo, step * 2
            lo = hi - step
        if lo < 1:
            lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


Prepare = Callable[[nn.Module, int], nn.Module]  # (model, batch) -> module that runs the step


def strategies(genetic_iters: tuple[int, ...], config: SublinearMemoryConfig | None, seq: int | None,
               spec: ModelSpec, baselines: bool = True) -> list[tuple[str, Prepare, bool]]:
    """(name, prepare, is_sublinear) for eager, the baselines and each genetic setting."""
    chosen: list[tuple[str, Prepare, bool]] = [("eager", lambda model, batch: model, False)]
    if baselines:
        for name, apply in BASELINES.items():
            applied: dict[int, nn.Module] = {}
            chosen.append((name, lambda model, batch, apply=apply, applied=applied:
                           applied.setdefault(id(model), apply(model)), False))
    base = config or SublinearMemoryConfig()
    for iters in genetic_iters:
        cfg = SublinearMemoryConfig(**{**base.planning_key(), "genetic_nr_iter": iters,
                                       "num_worker": base.num_worker, "cache_dir": base.cache_dir})
        compiled: dict[tuple[int, int], nn.Module] = {}

        def prepare(model, batch, cfg=cfg, compiled=compiled):
            key = (id(model), batch)
            if key not in compiled:
                args, kwargs = spec.example_inputs(batch, device="meta", seq=seq)
                compiled[key] = sublinear_compile(model, args, kwargs, config=cfg)
            return compiled[key]

        chosen.append(("sublinear grid" if iters == 0 else f"sublinear grid+genetic({iters})", prepare, True))
    return chosen


def compare(spec: ModelSpec, budget: int, genetic_iters: tuple[int, ...] = (0,), device: str = "meta",
            seq: int | None = None, baselines: bool = True, config: SublinearMemoryConfig | None = None,
            progress: Callable[[str], None] | None = None, autocast: torch.dtype | None = None
            ) -> list[StrategyResult]:
    """Max batch at ``budget`` bytes for eager, the hand-written baselines and sublinear with each genetic setting,
    with every step (and every plan) under ``torch.autocast(dtype=autocast)`` when given."""
    say = progress or log.info
    env = _Environment(device, autocast)
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    results = []
    for name, prepare, is_sublinear in strategies(genetic_iters, config, seq, spec, baselines):
        say(f"{spec.name}: {name} ...")
        model = env.build(spec)
        checked: dict[int, int | None] = {}

        def peak(batch: int) -> int | None:
            if batch not in checked:
                with env:
                    with env.autocast_context():
                        module = prepare(model, batch)
                    checked[batch] = _step_peak(spec, module, model, batch, env, seq)
            return checked[batch]

        def fits(batch: int) -> bool:
            try:
                p = peak(batch)
            except ValueError:
                if batch > 1:
                    raise
                return False  # e.g. BatchNorm refuses one sample of 1x1 maps in training
            return p is not None and p <= budget

        guess = 8
        if device == "meta":
            two, four = peak(2), peak(4)
            guess = max(1, 2 + int((budget - two) // max(1, (four - two) // 2)))
        best = largest_fitting(fits, guess)
        if best == 0:
            results.append(StrategyResult(name, 0, 0, float("nan"), None, None, device))
            continue
        planning = predicted = None
        if is_sublinear:
            plan = prepare(model, best).sublinear_plan
            planning, predicted = plan.planning_seconds, plan.predicted_peak_bytes
        results.append(StrategyResult(name, best, peak(best) or 0, _flops_ratio(spec, prepare, best, seq, env),
                                      planning, predicted, device if autocast is None else f"{device}+{autocast}"))
        say(f"{spec.name}: {name}: max batch {best}")
        del model
        gc.collect()
    return results


class _Environment:
    """Where strategies run: real device or data-less tensors, and the autocast state of every step and plan."""

    def __init__(self, device: str, autocast: torch.dtype | None) -> None:
        self.device, self.autocast = device, autocast
        fake = autocast is not None and device == "meta"
        self.data_device = "cpu" if fake else device
        self.autocast_device = "cuda" if device == "cuda" else "cpu"
        self.fake = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        if self.fake is not None:
            self.fake.cache_enabled = False  # its dispatch cache keeps tensors alive past their last use
        self._stack: list[contextlib.ExitStack] = []

    def build(self, spec: ModelSpec) -> nn.Module:
        with self:
            torch.manual_seed(0)
            with torch.device(self.data_device):
                return spec.build().train()

    def __enter__(self):
        stack = contextlib.ExitStack()
        if self.fake is not None:
            stack.enter_context(self.fake)
        self._stack.append(stack)
        return self

    def autocast_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast_device, dtype=self.autocast)

    def step(self, module: nn.Module, *args, **kwargs):
        """The standard mixed-precision step: forward under autocast, backward after it."""
        with self.autocast_context():
            outputs = module(*args, **kwargs)
        loss = default_loss(outputs)
        if loss is not None:
            loss.backward()
        return outputs

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


def _step_peak(spec: ModelSpec, module: nn.Module, model: nn.Module, batch: int, env: _Environment,
               seq: int | None) -> int | None:
    """Peak bytes of one training step, or None when it runs out of memory (CUDA)."""
    args, kwargs = spec.example_inputs(batch, device=env.data_device, seq=seq)
    model.zero_grad(set_to_none=True)
    try:
        return measure(env.step, module, *args, **kwargs).peak_bytes
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        del args, kwargs
        gc.collect()
        if env.device == "cuda":
            torch.cuda.empty_cache()


def _flops_ratio(spec: ModelSpec, prepare: Prepare, batch: int, seq: int | None, env: _Environment) -> float:
    """Step FLOPs of the strategy over eager's, both counted on data-less twins at ``batch``."""
    counts = []
    for make in (lambda model, b: model, prepare):
        twin = env if env.fake is not None else _Environment("meta", None)
        model = twin.build(spec)
        with twin:
            args, kwargs = spec.example_inputs(batch, device=twin.data_device, seq=seq)
            with twin.autocast_context():
                module = make(model, batch)
            with FlopCounterMode(display=False) as counter:
                twin.step(module, *args, **kwargs)
        counts.append(counter.get_total_flops())
    return counts[1] / counts[0] if counts[0] else float("nan")
