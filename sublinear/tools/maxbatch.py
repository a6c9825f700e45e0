"""Max batch size under a memory budget, for eager, hand-written checkpointing and sublinear plans.

On ``meta`` every candidate batch is run once under :func:`sublinear.measure` (no RAM is used, any batch size
works). With ``autocast``, and for transformers models, the model holds fake CPU tensors instead, equally free:
autocast dispatches on the device, which meta tensors lack, and transformers reads input values in its eager
forward (attention-mask and packed-sequence checks), which it skips on fake tensors only; plans are then made with
estimated op costs, as on meta. On ``cuda`` every candidate really runs: the budget is enforced with
``torch.cuda.set_per_process_memory_fraction`` and a batch fits when the step finishes without an out-of-memory
error; ``torch.cuda.max_memory_allocated`` gives its peak.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from sublinear.api import compile as sublinear_compile
from sublinear.tools.baselines import BASELINES, NotApplicable
from sublinear.capture.dynamo import CaptureError, FakeTwin
from sublinear.config import SublinearMemoryConfig
from sublinear.core.units import format_bytes
from sublinear.profiling.attention import FusedAttentionOnMeta
from sublinear.profiling.costs import REFERENCE_GPU, StepCost, device_rates
from sublinear.measurement import measure
from sublinear.models import ModelSpec
from sublinear.planners import BudgetError
from sublinear.planners.driver import StepFloor
from sublinear.training import step_backward
from sublinear.runtime import SublinearPlan

__all__ = ["NothingFits", "StepEnvironment", "StrategyResult", "Tuning", "TuningRow", "compare", "fixed_floor",
           "largest_fitting", "tune"]

log = logging.getLogger("sublinear.tools.maxbatch")


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    max_batch: int
    peak_bytes: int  # measured at max_batch
    flops_ratio: float  # step FLOPs at max_batch relative to eager's at the same batch
    time_ratio: float  # predicted step time at max_batch relative to eager's (the planner's cost model)
    planning_seconds: float | None  # sublinear only: capture + profile + plan at max_batch
    predicted_peak_bytes: int | None  # sublinear only
    device: str
    least_need: tuple[int, int] | None = None  # max_batch 0: (batch, bytes) at the smallest batch whose need is known


BATCH_LIMIT = 1 << 16  # the largest batch any search tries


def largest_fitting(fits: Callable[[int], bool], guess: int = 1, limit: int = BATCH_LIMIT) -> int:
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
Note = Callable[[str], None]  # one line on a strategy that was skipped


class DoesNotFit(Exception):
    """The strategy has no acceptable plan at this batch (budget unreachable or FLOPs over the limit);
    ``needed_bytes``: the lowest predicted peak found, when a search ran."""

    def __init__(self, message: str, needed_bytes: int | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class NothingFits(ValueError):
    """No strategy fits the smallest batch in the budget; the message names what the step needs."""


def strategies(genetic_iters: tuple[int, ...], config: SublinearMemoryConfig | None, seq: int | None,
               spec: ModelSpec, baselines: bool = True, budget: int | None = None,
               time_limits: tuple[float, ...] = ()) -> list[tuple[str, Prepare]]:
    """(name, prepare) for eager, the baselines, and sublinear planning for ``budget`` (the least predicted step
    time that fits) with each genetic setting under the config's time cap, then with the largest setting under each
    of ``time_limits``."""
    chosen: list[tuple[str, Prepare]] = [("eager", lambda model, batch: model)]
    if baselines:
        chosen.extend((name, _applied_once(apply)) for name, apply in BASELINES.items())
    base = config or SublinearMemoryConfig()

    def name(iters: int, cap: float) -> str:
        search = "+".join(f"genetic({iters})" if p == "genetic" else p for p in base.planners
                          if p != "genetic" or iters)
        return f"sublinear {search}, time <= {cap:g}" if math.isfinite(cap) else f"sublinear {search}, no time cap"

    budgeted = replace(base, memory_budget=budget)
    for iters in genetic_iters:
        chosen.append((name(iters, base.max_time_ratio),
                       _PlannedAtBatch(spec, seq, replace(budgeted, genetic_nr_iter=iters))))
    longest = max(genetic_iters, default=0)
    for cap in time_limits:
        chosen.append((name(longest, cap),
                       _PlannedAtBatch(spec, seq, replace(budgeted, genetic_nr_iter=longest, max_time_ratio=cap))))
    return chosen


class _PlannedAtBatch:
    """A sublinear strategy's prepare: the model compiled and planned ahead at each batch, with the wall time that
    took (capture, profile and search of every graph, including planning graphs again for each other).

    Only the latest compiled module is kept: a search probes dozens of batches, and every module kept grows the
    heap that each full garbage collection walks, which then lands inside later plannings' wall time. Of the
    others, the plan (as their step left it) and the planning time remain."""

    def __init__(self, spec: ModelSpec, seq: int | None, config: SublinearMemoryConfig) -> None:
        self.spec, self.seq, self.config = spec, seq, config
        self.planning_seconds: dict[tuple[int, int], float] = {}
        self._plans: dict[tuple[int, int], SublinearPlan | None] = {}
        self._latest: tuple[tuple[int, int], nn.Module] | None = None

    def __call__(self, model: nn.Module, batch: int) -> nn.Module:
        key = (id(model), batch)
        if self._latest is None or self._latest[0] != key:
            if self._latest is not None:
                self._plans[self._latest[0]] = self._latest[1].sublinear_plan
            self._latest = None
            args, kwargs = self.spec.example_inputs(batch, device="meta", seq=self.seq)
            started = time.perf_counter()
            try:
                compiled = sublinear_compile(model, args, kwargs, config=self.config)
            except BudgetError as exc:
                raise DoesNotFit(str(exc), exc.smallest) from None
            self.planning_seconds[key] = time.perf_counter() - started
            self._latest = (key, compiled)
        compiled = self._latest[1]
        if compiled.sublinear_plan is None:
            raise DoesNotFit(f"{self.spec.name} cannot be planned ahead on data-less tensors")
        return compiled

    def plan(self, model: nn.Module, batch: int) -> SublinearPlan:
        """The plan at ``batch`` as its latest step left it."""
        key = (id(model), batch)
        if self._latest is not None and self._latest[0] == key:
            return self._latest[1].sublinear_plan
        return self._plans[key]


def _applied_once(apply: Callable[[nn.Module], nn.Module]) -> Prepare:
    """A baseline's prepare: ``apply`` edits a model in place, so each model is edited once, at its first batch."""
    applied: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def prepare(model: nn.Module, batch: int) -> nn.Module:
        if model not in applied:
            apply(model)
            applied.add(model)
        return model
    return prepare


def compare(spec: ModelSpec, budget: int, genetic_iters: tuple[int, ...] = (0,), device: str = "meta",
            seq: int | None = None, baselines: bool = True, config: SublinearMemoryConfig | None = None,
            progress: Progress | None = None, autocast: torch.dtype | None = None,
            time_limits: tuple[float, ...] = (), note: Note | None = None) -> list[StrategyResult]:
    """Max batch at ``budget`` bytes for eager, the hand-written baselines, and sublinear planning for the budget
    with each genetic setting (and under each of ``time_limits``; see :func:`strategies`), with every step (and
    every plan) under ``torch.autocast(dtype=autocast)`` when given. ``progress(done, total, message)`` follows the
    strategies. A baseline that does not apply to the model has no row: ``note`` (default: a logged warning) gets
    one line on it. :class:`NothingFits` when the budget is below :func:`fixed_floor`, before any strategy runs, or
    when no strategy fits batch 1."""
    say = progress or (lambda done, total, message: log.info(message))
    skipped = note or log.warning
    floor = fixed_floor(spec, seq)
    if budget < floor.total:
        raise NothingFits(f"{spec.name}: the budget ({format_bytes(budget)}) is below what a training step holds at "
                          f"batch 1 whatever the strategy: {floor} (optimizer state, if any, comes on top); raise the "
                          f"budget to at least {format_bytes(floor.total)}")
    env = StepEnvironment.for_model(spec, device, autocast)
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    config = config or SublinearMemoryConfig()
    if env.fake is not None and config.cost_model == "auto":
        config = replace(config, cost_model="reference")  # as on meta, which the fake CPU tensors stand for
    chosen = strategies(genetic_iters, config, seq, spec, baselines, budget, time_limits)
    results = []
    for done, (name, prepare) in enumerate(chosen):
        say(done, len(chosen), f"{spec.name}: {name} ...")
        try:
            results.append(_largest_batch(spec, name, prepare, budget, env, seq))
        except Exception as exc:  # noqa: BLE001 - a hand-written baseline that fails on this model is left out
            if name not in BASELINES:
                raise
            reason = exc if isinstance(exc, NotApplicable) else f"it fails on this model: {type(exc).__name__}: {exc}"
            skipped(f"{spec.name}: {name} skipped: {' '.join(str(reason).split())}")
            say(done + 1, len(chosen), f"{spec.name}: {name}: does not apply")
        else:
            say(done + 1, len(chosen), f"{spec.name}: {name}: max batch {results[-1].max_batch}")
        if device == "cuda":  # the next strategy starts with the device's memory free
            gc.collect()
    if results and not any(r.max_batch for r in results):
        text = f"{spec.name}: no strategy fits batch 1 in {format_bytes(budget)}"
        known = [(r.least_need, r.strategy) for r in results if r.least_need is not None]
        if known:
            (batch, nbytes), strategy = min(known)
            text += (f"; the least needed is {format_bytes(nbytes)} ({strategy} at batch {batch}): raise the budget "
                     "to at least that")
        raise NothingFits(text)
    return results


def fixed_floor(spec: ModelSpec, seq: int | None) -> StepFloor:
    """What a training step of ``spec`` at batch 1 holds whatever the strategy: the parameters, buffers and inputs,
    and the parameters' gradients when it ends (counted on a data-less build)."""
    with torch.device("meta"):
        model = spec.build()
    args, kwargs = spec.example_inputs(1, device="meta", seq=seq)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return StepFloor((("parameters", nbytes(model.parameters())), ("buffers", nbytes(model.buffers())),
                      ("inputs", nbytes(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))),
                      ("gradients", nbytes(p for p in model.parameters() if p.requires_grad))))


def _largest_batch(spec: ModelSpec, name: str, prepare: Prepare, budget: int, env: StepEnvironment,
                   seq: int | None) -> StrategyResult:
    """One strategy's max batch on a fresh model; on meta, the search starts from :func:`_bracket`."""
    model = env.build(spec)
    checked: dict[int, int | None] = {}
    needed: dict[int, int] = {}  # per batch: the measured peak, or the lowest predicted peak of a plan that missed

    def peak(batch: int) -> int | None:
        if batch not in checked:
            with env:
                try:
                    with env.autocast_context():
                        module = prepare(model, batch)
                except DoesNotFit as exc:
                    checked[batch] = None
                    if exc.needed_bytes is not None:
                        needed[batch] = exc.needed_bytes
                else:
                    checked[batch] = _step_peak(spec, module, model, batch, env, seq)
                    if checked[batch] is not None:
                        needed[batch] = checked[batch]
        return checked[batch]

    def fits(batch: int) -> bool:
        try:
            p = peak(batch)
        except NotApplicable:
            raise
        except (ValueError, CaptureError):
            if batch > 1:
                raise
            return False  # e.g. BatchNorm refuses one sample of 1x1 maps in training (in a capture too)
        return p is not None and p <= budget

    start, over = _bracket(peak, budget) if env.device == "meta" else (8, None)
    best = largest_fitting(fits, start, BATCH_LIMIT if over is None else over - 1)
    label = env.device if env.autocast is None else f"{env.device}+{env.autocast}"
    if best == 0:
        least = min(needed.items(), default=None)
        return StrategyResult(name, 0, 0, float("nan"), float("nan"), None, None, label, least)
    if isinstance(prepare, _PlannedAtBatch):  # TorchDynamo does not compile under a cost-counting dispatch mode:
        # the plan's own count
        plan = prepare.plan(model, best)
        return StrategyResult(name, best, peak(best) or 0, plan.flops_ratio, plan.time_ratio,
                              prepare.planning_seconds[id(model), best], plan.predicted_peak_bytes, label)
    flops, seconds = _cost_ratios(spec, prepare, best, seq, env)
    return StrategyResult(name, best, peak(best) or 0, flops, seconds, None, None, label)


def _bracket(peak: Callable[[int], int | None], budget: int, refinements: int = 6) -> tuple[int, int | None]:
    """(a batch to start the search from, a batch known not to fit or None), from measured peaks (None: does not
    fit). A step's peak is the largest of the live bytes at its moments, each affine in the batch, so it grows
    convexly: the line through the peaks at batches 2 and 4 meets the budget at or beyond the largest batch that
    fits, and the line through a batch that fits and one that does not meets it at a batch that fits (false
    position, ``refinements`` times). Only the search's monotonicity assumption matters for its result."""
    two, four = peak(2), peak(4)
    if two is None or four is None:
        return 8, None
    if two > budget:
        return 1, 2
    if four > budget:
        return 2, 4
    if four <= two:
        return 4, None
    fit, fit_peak = 4, four
    over: int | None = None
    over_peak: int | None = None
    candidate = 4 + int((budget - four) * 2 // (four - two))
    for _ in range(refinements):
        candidate = min(max(candidate, fit + 1), BATCH_LIMIT)  # a line may round down to the batch that fits
        if candidate <= fit or (over is not None and candidate >= over):
            break
        measured = peak(candidate)
        if measured is None or measured > budget:
            over, over_peak = candidate, measured
            if measured is None:
                break
        elif over is None and candidate == fit + 1:  # the line fell short: the search steps up from here
            fit = candidate
            break
        else:
            fit, fit_peak = candidate, measured
        if over is None:
            candidate = fit + 1
        else:
            candidate = fit + int((budget - fit_peak) * (over - fit) // (over_peak - fit_peak))
    return fit, over


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
         progress: Progress | None = None, seq: int | None = None) -> Tuning:
    """The genetic-iteration sweep: for each ``genetic_nr_iter``, the best peak and search time at the reference
    batch, and the max batch at ``budget``; text models at ``seq`` (default: the model's)."""
    from sublinear.capture.dynamo import capture
    from sublinear.planners import PlanningProblem, make_plan, objective_for
    from sublinear.planners.genetic import genetic_search
    from sublinear.profiling.graph import profile

    base = config or SublinearMemoryConfig()
    batch = REFERENCE_BATCH["text" if spec.default_seq else "image"]
    seq = spec.default_seq if seq is None else seq
    with torch.device("meta"):
        model = spec.build().train()
    args, kwargs = spec.example_inputs(batch, device="meta", seq=seq)
    graph = profile(capture(model, args, kwargs).graph)
    planned = {k: make_plan(graph, replace(base, genetic_nr_iter=k)) for k in genetic_iters}
    longest = planned[max(genetic_iters)]
    start = replace(base, genetic_nr_iter=0)
    initial = genetic_search(PlanningProblem(graph, objective_for(start, None), start),
                             [c.plan for c in longest.candidates])
    batches = compare(spec, budget, genetic_iters, seq=seq, baselines=False, config=base,
                      progress=progress)[1:]  # the first row is eager
    rows = tuple(TuningRow(k, planned[k].simulation.peak_bytes, planned[k].seconds, r.max_batch, r.planning_seconds)
                 for k, r in zip(genetic_iters, batches))
    return Tuning(batch, rows, tuple(c.simulation.peak_bytes for c in longest.history), initial.logbook[0]["best"])


def _reads_input_values(model: nn.Module) -> bool:
    """transformers models read input values in their eager forward (unless the tensors are fake)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


class StepEnvironment:
    """Where strategies run: real device or data-less tensors (meta, or fake CPU ones with ``fake``), and the
    autocast state of every step and plan."""

    def __init__(self, device: str, autocast: torch.dtype | None, fake: bool = False) -> None:
        self.device, self.autocast = device, autocast
        fake = device == "meta" and (fake or autocast is not None)
        self.data_device = "cpu" if fake else device
        self.autocast_device = "cuda" if device == "cuda" else "cpu"
        self.fake = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        if self.fake is not None:
            self.fake.cache_enabled = False  # its dispatch cache keeps tensors alive past their last use
        self._stack: list[contextlib.ExitStack] = []

    @staticmethod
    def for_model(spec: ModelSpec, device: str, autocast: torch.dtype | None) -> StepEnvironment:
        """The environment for ``spec``: fake CPU tensors for data-less runs of models that read input values."""
        with torch.device("meta"):
            probe = spec.build()
        return StepEnvironment(device, autocast, fake=_reads_input_values(probe))

    def build(self, spec: ModelSpec) -> nn.Module:
        """A fresh model in training mode; with fake tensors, built on meta (initialisers that read values, such as
        ``trunc_normal_``, fail on fakes) and then twinned on fake CPU tensors."""
        torch.manual_seed(0)
        if self.fake is None:
            with torch.device(self.data_device):
                return spec.build().train()
        with torch.device("meta"):
            model = spec.build()
        twin = FakeTwin()
        twin.mode = self.fake  # the steps run in this mode, and fakes of two modes do not mix
        return twin.module(model, torch.device(self.data_device)).train()

    def __enter__(self):
        stack = contextlib.ExitStack()
        if self.fake is not None:
            stack.enter_context(self.fake)
        elif self.device == "meta":  # attention's cost as counted for every strategy: CPU's fused kernel, as planned
            stack.enter_context(FusedAttentionOnMeta())
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
        step_backward(outputs)  # the backward every prediction describes
        return outputs

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


def _step_peak(spec: ModelSpec, module: nn.Module, model: nn.Module, batch: int, env: StepEnvironment,
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
        if env.device == "cuda":  # data-less steps hold no memory, and each measurement counts only its own step
            gc.collect()
            torch.cuda.empty_cache()


def _cost_ratios(spec: ModelSpec, prepare: Prepare, batch: int, seq: int | None,
                 env: StepEnvironment) -> tuple[float, float]:
    """Step FLOPs and predicted step time of the strategy over eager's, both counted on data-less twins at
    ``batch`` with the planner's cost model (the reference GPU's rates, as plans on data-less tensors use; the
    device's on CUDA)."""
    rates = device_rates("cuda") if env.device == "cuda" else REFERENCE_GPU
    counts = []
    for make in (lambda model, b: model, prepare):
        twin = env if env.fake is not None else StepEnvironment("meta", None)
        model = twin.build(spec)
        with twin:
            args, kwargs = spec.example_inputs(batch, device=twin.data_device, seq=seq)
            with twin.autocast_context():
                module = make(model, batch)
            with StepCost(rates) as cost:
                twin.step(module, *args, **kwargs)
        counts.append(cost)
    eager, strategy = counts
    return (strategy.flops / eager.flops if eager.flops else float("nan"),
            strategy.seconds / eager.seconds if eager.seconds else float("nan"))
