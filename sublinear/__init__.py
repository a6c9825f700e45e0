"""sublinear: train PyTorch models with sublinear activation memory.

Pipeline: capture → profile → simulate → plan (grid, genetic) → rewrite. ``compile`` runs all of it.
"""

from .api import SublinearModule, SublinearPlan, compile, trace
from .tracer import CaptureError, capture
from .config import SublinearMemoryConfig
from .measurement import MemoryReport, measure
from .plan import Plan, PlanError
from .profiler import GraphProfile, profile
from .rewriter import RecomputeError, rewrite
from .simulator import Simulation, simulate

__all__ = [
    "CaptureError", "GraphProfile", "MemoryReport", "Plan", "PlanError", "RecomputeError", "Simulation",
    "SublinearMemoryConfig", "SublinearModule", "SublinearPlan", "capture", "compile", "measure", "profile", "rewrite",
    "simulate", "trace",
]
__version__ = "0.1.0"
