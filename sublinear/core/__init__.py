"""The data every pipeline stage shares, free of torch: the profile of a step, a plan, what a plan means for each
storage (the analysis), and the objective planners optimise. Planners and the simulator read only this."""

from .analysis import PlanAnalysis, StorageState, analyse
from .objective import Candidate, Objective, Simulation
from .plan import Plan, PlanError
from .profile import GraphProfile, NodeFacts, OpProfile, ShardedParameters, StepContext

__all__ = ["Candidate", "GraphProfile", "NodeFacts", "Objective", "OpProfile", "Plan", "PlanAnalysis", "PlanError",
           "ShardedParameters", "Simulation", "StepContext", "StorageState", "analyse"]
