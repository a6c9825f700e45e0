"""The runtime: what runs each captured graph under its plan, and what it reports.

- :mod:`.session`: :class:`SublinearBackend`, the ``torch.compile`` backend, one session per compiled model: its
  graphs, its calls and its plan pipeline; :func:`rewritten`, a captured graph as a session runs it.
- :mod:`.graph`: what TorchDynamo calls in place of one captured graph (its variants by call signature).
- :mod:`.calls`: the training calls the session saw: each graph's step context and what the call did with its
  outputs.
- :mod:`.pipeline`: profile → plan → executor per graph and signature, and the caches of each stage.
- :mod:`.compile_check`: a planned graph's first compile read back: the profile taught what inductor's code held,
  and, above its budget, alternate plans judged by the wrapper code inductor generates for them without kernels.
- :mod:`.variant`: a graph planned for one call signature.
- :mod:`.step`: a training call's graph runs and what they tell each graph (step contexts, output uses).
- :mod:`.modules`: a module's forward run through the backend (:func:`compile_module`), and planning ahead on a
  data-less twin (:func:`plan_ahead`).
- :mod:`.plans`: what a plan says, for people (:class:`SublinearPlan`).
"""

from sublinear.runtime.session import SublinearBackend, backend, collecting_new_objects_only, rewritten
from sublinear.runtime.modules import compile_module, plan_ahead
from sublinear.runtime.plans import BlockSummary, GraphPlan, ParetoPoint, SublinearPlan
from sublinear.runtime.step import output_uses, step_contexts

__all__ = ["BlockSummary", "GraphPlan", "ParetoPoint", "SublinearBackend", "SublinearPlan", "backend",
           "collecting_new_objects_only", "compile_module", "output_uses", "plan_ahead", "rewritten", "step_contexts"]
