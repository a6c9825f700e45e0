"""``sublinear.compile``: capture → profile → plan → rewrite, in one call."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .tracer import capture
from .config import SublinearMemoryConfig
from .plan import Plan
from .planner import PlanningResult, make_plan
from .profiler import GraphProfile, profile
from .rewriter import CheckpointedModule, rewrite

__all__ = ["SublinearPlan", "compile"]


@dataclass(frozen=True)
class SublinearPlan:
    """The plan a compiled module runs, with its predictions at the example inputs (bytes, FLOPs)."""

    split_points: tuple[int, ...]
    kept_ops: tuple[int, ...]
    num_ops: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    history: tuple[int, ...]
    planning_seconds: float  # capture + profile + search
    search_seconds: float  # grid (+ genetic) search alone
    capture_method: str

    @property
    def num_blocks(self) -> int:
        return len(self.split_points)

    @property
    def flops_ratio(self) -> float:
        """Step FLOPs relative to eager, taking backward as twice forward."""
        return 1 + self.recompute_flops / (3 * self.forward_flops) if self.forward_flops else 1.0

    def __str__(self) -> str:
        mib = 2**20
        return (f"{self.num_blocks} blocks over {self.num_ops} ops: predicted peak "
                f"{self.predicted_peak_bytes / mib:.1f} MiB vs eager {self.baseline_peak_bytes / mib:.1f} MiB, "
                f"recompute {self.recompute_flops / 1e9:.2f} GFLOP (step FLOPs x{self.flops_ratio:.3f})")


def compile(module: nn.Module, example_inputs: Sequence[Any] = (), example_kwargs: dict[str, Any] | None = None,
            config: SublinearMemoryConfig | None = None) -> CheckpointedModule:
    """Plan ``module`` at the example inputs (real or meta tensors) and return a module that recomputes per plan.

    The returned module shares ``module``'s parameters, buffers and submodules; ``.sublinear_plan`` describes
    the plan.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sublinear.compile needs an nn.Module, got {type(module).__name__}")
    if config is not None and not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"config must be a SublinearMemoryConfig, got {type(config).__name__}")
    config = config or SublinearMemoryConfig()
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    started = time.perf_counter()
    with _training(module):
        captured = capture(module, example_inputs, example_kwargs)
        graph_profile = profile(captured, example_inputs, example_kwargs)
    result = make_plan(graph_profile, config)
    compiled = rewrite(captured, graph_profile, result.plan)
    compiled.sublinear_plan = describe(graph_profile, result, captured.method, time.perf_counter() - started)
    compiled.sublinear_profile = graph_profile
    return compiled


def describe(graph_profile: GraphProfile, result: PlanningResult, capture_method: str,
             planning_seconds: float) -> SublinearPlan:
    plan: Plan = result.plan
    return SublinearPlan(
        split_points=plan.split_points, kept_ops=tuple(sorted(plan.kept)), num_ops=graph_profile.num_ops,
        predicted_peak_bytes=result.simulation.peak_bytes, baseline_peak_bytes=result.baseline.peak_bytes,
        recompute_flops=result.simulation.recompute_flops, forward_flops=graph_profile.forward_flops,
        history=result.history, planning_seconds=planning_seconds, search_seconds=result.seconds,
        capture_method=capture_method)


@contextlib.contextmanager
def _training(module: nn.Module):
    """Capture and profile the training graph; restore every submodule's mode afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
