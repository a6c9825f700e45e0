"""sublinear: train PyTorch models with sublinear activation memory.

Pipeline: capture → profile → simulate → plan (grid, genetic) → rewrite. ``compile`` runs all of it.
"""

from .api import ParetoPoint, SublinearModule, SublinearPlan, compile, pareto, trace
from .planner import BudgetError
from .tracer import CaptureError, capture
from .config import SublinearMemoryConfig, parse_size
from .measurement import MemoryReport, measure, measure_cpu_allocator
from .plan import Plan, PlanError
from .profiler import GraphProfile, profile
from .rewriter import RecomputeError, rewrite
from .simulator import Simulation, simulate

__all__ = [
    "BudgetError", "CaptureError", "ParetoPoint", "pareto", "GraphProfile", "MemoryReport", "Plan", "PlanError", "RecomputeError", "Simulation",
    "SublinearMemoryConfig", "SublinearModule", "SublinearPlan", "capture", "compile", "measure", "measure_cpu_allocator", "parse_size", "profile", "rewrite",
    "simulate", "trace",
]
__version__ = "0.1.0"
