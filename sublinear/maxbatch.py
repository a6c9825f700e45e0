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
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from .api import compile as sublinear_compile
from .baselines import BASELINES
from .config import SublinearMemoryConfig
from .measurement import measure
from .models import ModelSpec
from .planners import BudgetError
from .profiler import default_loss

__all__ = ["StrategyResult", "Tuning", "TuningRow", "baseline_costs", "compare", "largest_fitting", "tune"]

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
Progress = Callable[[int, int, str], None]  # (strategies done, strategies in all, message)


class DoesNotFit(Exception):
    """The strategy has no acceptable plan at this batch (budget unreachable or FLOPs over the limit)."""


def strategies(genetic_iters: tuple[int, ...], config: SublinearMemoryConfig | None, seq: int | None,
               spec: ModelSpec, baselines: bool = True, budget: int | None = None,
               flops_limits: tuple[float, ...] = ()) -> list[tuple[str, Prepare, bool]]:
    """(name, prepare, is_sublinear) for eager, the baselines, each genetic setting, and the budget-driven planner
    under each FLOPs-ratio limit."""
    chosen: list[tuple[str, Prepare, bool]] = [("eager", lambda model, batch: model, False)]
    if baselines:
        for name, apply in BASELINES.items():
            applied: dict[int, nn.Module] = {}
            chosen.append((name, lambda model, batch, apply=apply, applied=applied:
                           applied.setdefault(id(model), apply(model)), False))
    base = config or SublinearMemoryConfig()

    def planned(cfg: SublinearMemoryConfig, limit: float = math.inf) -> Prepare:
        compiled: dict[tuple[int, int], nn.Module] = {}

        def prepare(model: nn.Module, batch: int) -> nn.Module:
            key = (id(model), batch)
            if key not in compiled:
                args, kwargs = spec.example_inputs(batch, device="meta", seq=seq)
                try:
                    compiled[key] = sublinear_compile(model, args, kwargs, config=cfg)
                except BudgetError as exc:
                    raise DoesNotFit(str(exc)) from None
            plan = compiled[key].sublinear_plan
            if plan is None:
                raise DoesNotFit(f"{spec.name} cannot be planned ahead on data-less tensors")
            ratio = plan.flops_ratio
            if ratio > limit:
                raise DoesNotFit(f"the least-recompute plan within the budget needs FLOPs x{ratio:.3f}")
            return compiled[key]
        return prepare

    for iters in genetic_iters:
        chosen.append(("sublinear grid" if iters == 0 else f"sublinear grid+genetic({iters})",
                       planned(replace(base, genetic_nr_iter=iters)), True))
    for limit in flops_limits:
        cfg = replace(base, memory_budget=budget, genetic_nr_iter=max(genetic_iters, default=0))
        chosen.append((f"sublinear budget, FLOPs <= {limit:g}", planned(cfg, limit), True))
    return chosen


def compare(spec: ModelSpec, budget: int, genetic_iters: tuple[int, ...] = (0,), device: str = "meta",
            seq: int | None = None, baselines: bool = True, config: SublinearMemoryConfig | None = None,
            progress: Progress | None = None, autocast: torch.dtype | None = None,
            flops_limits: tuple[float, ...] = ()) -> list[StrategyResult]:
    """Max batch at ``budget`` bytes for eager, the hand-written baselines, sublinear with each genetic setting and
    the budget-driven planner under each FLOPs-ratio limit, with every step (and every plan) under
    ``torch.autocast(dtype=autocast)`` when given. ``progress(done, total, message)`` follows the strategies."""
    say = progress or (lambda done, total, message: log.info(message))
    env = _Environment(device, autocast)
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    chosen = strategies(genetic_iters, config, seq, spec, baselines, budget, flops_limits)
    results = []
    for done, (name, prepare, is_sublinear) in enumerate(chosen):
        say(done, len(chosen), f"{spec.name}: {name} ...")
        results.append(_largest_batch(spec, name, prepare, is_sublinear, budget, env, seq))
        say(done + 1, len(chosen), f"{spec.name}: {name}: max batch {results[-1].max_batch}")
        gc.collect()
    return results


def _largest_batch(spec: ModelSpec, name: str, prepare: Prepare, is_sublinear: bool, budget: int,
                   env: _Environment, seq: int | None) -> StrategyResult:
    """One strategy's max batch on a fresh model; on meta, the search starts from an affine fit of batches 2
    and 4."""
    model = env.build(spec)
    checked: dict[int, int | None] = {}

    def peak(batch: int) -> int | None:
        if batch not in checked:
            with env:
                try:
                    with env.autocast_context():
                        module = prepare(model, batch)
                except DoesNotFit:
                    checked[batch] = None
                else:
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
    two, four = (peak(2), peak(4)) if env.device == "meta" else (None, None)
    if two is not None and four is not None:
        guess = max(1, 2 + int((budget - two) // max(1, (four - two) // 2)))
    best = largest_fitting(fits, guess)
    label = env.device if env.autocast is None else f"{env.device}+{env.autocast}"
    if best == 0:
        return StrategyResult(name, 0, 0, float("nan"), None, None, label)
    planning = predicted = None
    if is_sublinear:
        plan = prepare(model, best).sublinear_plan
        planning, predicted = plan.planning_seconds, plan.predicted_peak_bytes
    return StrategyResult(name, best, peak(best) or 0, _flops_ratio(spec, prepare, best, seq, env), planning,
                          predicted, label)


def baseline_costs(spec: ModelSpec, batch: int, seq: int | None = None) -> dict[str, tuple[int, float]]:
    """(measured peak bytes, step FLOPs ratio) of eager and each hand-written strategy at ``batch``, on meta."""
    env = _Environment("meta", None)
    costs = {}
    for name, prepare, _ in strategies((), None, seq, spec):
        model = env.build(spec)
        with env:
            module = prepare(model, batch)
        costs[name] = (_step_peak(spec, module, model, batch, env, seq), _flops_ratio(spec, prepare, batch, seq, env))
    return costs


REFERENCE_BATCH = {"image": 64, "text": 8}  # where tune() compares best peaks: small enough to plan in a second
CONVERGED = 0.01  # tune(): converged once the best peak stays within 1 % of its final value


@dataclass(frozen=True)
class TuningRow:
    genetic_nr_iter: int
    peak_bytes: int  # best predicted peak at the reference batch
    search_seconds: float  # grid (+ genetic) search at the reference batch
    max_batch: int  # at the budget
    planning_seconds: float | None  # capture + profile + search at max_batch


@dataclass(frozen=True)
class Tuning:
    batch: int  # the reference batch
    rows: tuple[TuningRow, ...]
    history: tuple[int, ...]  # best peak after the grid and after each generation, for the largest setting
    initial_best: int  # best peak of the genetic search's initial population (grid and uniform seeds)

    @property
    def converged_at(self) -> int:
        """First generation from which the best peak stays within CONVERGED of its final value."""
        final = self.history[-1]
        return next(g for g in range(len(self.history)) if max(self.history[g:]) <= final * (1 + CONVERGED))


def tune(spec: ModelSpec, genetic_iters: tuple[int, ...], budget: int, config: SublinearMemoryConfig | None = None,
         progress: Progress | None = None) -> Tuning:
    """The genetic-iteration sweep: for each ``genetic_nr_iter``, the best peak and search time at the reference
    batch, and the max batch at ``budget``."""
    from .capture import capture
    from .planners import PlanningProblem, make_plan, objective_for
    from .planners.genetic import genetic_search
    from .profiler import profile

    base = config or SublinearMemoryConfig()
    batch = REFERENCE_BATCH["text" if spec.default_seq else "image"]
    with torch.device("meta"):
        model = spec.build().train()
    args, kwargs = spec.example_inputs(batch, device="meta", seq=spec.default_seq)
    graph = profile(capture(model, args, kwargs).graph)
    planned = {k: make_plan(graph, replace(base, genetic_nr_iter=k)) for k in genetic_iters}
    longest = planned[max(genetic_iters)]
    start = replace(base, genetic_nr_iter=0)
    initial = genetic_search(PlanningProblem(graph, objective_for(start, None), start),
                             [c.plan for c in longest.candidates])
    batches = compare(spec, budget, genetic_iters, seq=spec.default_seq, baselines=False, config=base,
                      progress=progress)[1:]  # the first row is eager
    rows = tuple(TuningRow(k, planned[k].simulation.peak_bytes, planned[k].seconds, r.max_batch, r.planning_seconds)
                 for k, r in zip(genetic_iters, batches))
    return Tuning(batch, rows, tuple(c.simulation.peak_bytes for c in longest.history), initial.logbook[0]["best"])


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
