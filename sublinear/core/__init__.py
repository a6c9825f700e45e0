"""The data every pipeline stage shares, free of torch: the profile of a step, a plan, what a plan means for each
storage (the analysis), and the objective planners optimise. Planners and the simulator read only this.

Glossary (each word in one sense across the stages):

- *op*: a planning unit, one or more contiguous operator nodes of a captured graph (:class:`OpProfile`).
- *node*: a node of the fx graph; an operator node's *rank* is its position among the graph's operator nodes,
  the order in which backward visits them in reverse. A process of a process group is a *process* here, never a
  rank (the user docs keep PyTorch's word).
- *storage*: one allocation; views and in-place results share their base's storage.
- *block*: the ops between two split points; a *recomputed* block is re-run in backward. *Soft* split points join
  blocks into a *group* whose crossing values are rebuilt, not held.
- *kept op* (``Plan.kept``, MegEngine's word): an op inside a recomputed block that is never re-run; "kept" means
  nothing else.
- *retained* storage: one forward holds for backward or later blocks (:class:`StorageState` ``RETAINED``, against
  ``REBUILT`` and ``TRANSIENT``); a block's *retained bytes* are its retained storages.
- *held*: what the caller holds between graphs or after the step (inputs; an output used ``HELD``, to the step's
  end without a gradient, against ``GRADIENT``, ``PASSED`` (a gradient, let go before backward) and ``DROPPED``),
  never a plan's choice.
"""

from sublinear.core.analysis import PlanAnalysis, StorageState, analyse
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan, PlanError
from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile, ShardedParameters, StepContext

__all__ = ["Candidate", "GraphProfile", "NodeFacts", "Objective", "OpProfile", "Plan", "PlanAnalysis", "PlanError",
           "ShardedParameters", "Simulation", "StepContext", "StorageState", "analyse"]
