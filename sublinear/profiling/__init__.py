"""Profile: a captured graph's training step as a torch-free :class:`~sublinear.core.profile.GraphProfile`. One
profiling stage with two front ends, each producing a :class:`~sublinear.profiling.record.StepRecord` that
:func:`~sublinear.profiling.record.assemble` turns into the profile:

- :mod:`.graph`: the eager front end, :func:`~sublinear.profiling.graph.profile` runs the step once (fake, meta or
  real tensors) with every storage tracked (views and in-place ops alias, :mod:`.tracking`); the run is traced in
  :mod:`.eager_trace` and its costs read off the trace in :mod:`.eager_costs`;
- :mod:`.compiled`: the compiled front end, :func:`~sublinear.profiling.compiled.profile_joint` reads the joint
  forward and backward graph inductor compiles: its ops, storages and reads (:mod:`.compiled_dataflow`), its costs
  (:mod:`.compiled_costs`, with the buffers inductor writes in place in :mod:`.compiled_inplace`) and what inductor
  makes of each node (:mod:`.compiled_nodes`).

Costs: op times measured on the device or estimated from FLOPs and bytes moved (:mod:`.costs`); library kernels'
scratch space measured on the device whatever times the ops (:mod:`.kernels`).
"""

from sublinear.profiling import attention as _attention  # noqa: F401  (counts CPU's fused attention's FLOPs)
