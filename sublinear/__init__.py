"""sublinear: train PyTorch models with sublinear activation memory.

Pipeline: capture (TorchDynamo) → profile → simulate → plan → compile (inductor, the plan as AOTAutograd's
partition; ``sublinear.execute.compiled``) or rewrite (sublinear's eager executor). ``sublinear.backend`` is the
``torch.compile`` backend that runs all of it; ``compile``, ``apply`` and ``trace`` are built on it.

The planning core (``sublinear.core``), the simulator and the planners never import torch; the names below are
loaded on first use, so ``import sublinear.core`` stays torch-free.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "SublinearModule": "api", "apply": "api", "compile": "api", "pareto": "api", "remove": "api", "trace": "api",
    "ParetoPoint": "runtime", "SublinearBackend": "runtime", "SublinearPlan": "runtime", "backend": "runtime",
    "CaptureError": "capture.dynamo",
    "SublinearMemoryConfig": "config", "parse_size": "config",
    "Candidate": "core", "GraphProfile": "core", "Objective": "core", "Plan": "core", "PlanAnalysis": "core",
    "PlanError": "core", "Simulation": "core", "StorageState": "core", "analyse": "core",
    "MemoryReport": "measurement", "measure": "measurement", "measure_cpu_allocator": "measurement",
    "BudgetError": "planners", "Planner": "planners", "make_plan": "planners", "register_planner": "planners",
    "profile": "profiling.graph",
    "RecomputeError": "execute.eager", "rewrite": "execute.eager",
    "simulate": "simulation.timeline", "timeline": "simulation.timeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sublinear' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
