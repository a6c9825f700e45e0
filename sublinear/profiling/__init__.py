"""Profile: a captured graph's training step as a torch-free :class:`~sublinear.core.profile.GraphProfile`. One
profiling stage with two front ends, each producing a :class:`~sublinear.profiling.record.StepRecord` that
:func:`~sublinear.profiling.record.assemble` turns into the profile:

- :mod:`.graph`: the eager front end, :func:`~sublinear.profiling.graph.profile` runs the step once (fake, meta or
  real tensors) with every storage tracked (views and in-place ops alias, :mod:`.tracking`);
- :mod:`.compiled`: the compiled front end, :func:`~sublinear.profiling.compiled.profile_joint` reads the joint
  forward and backward graph inductor compiles.

Costs: op times measured on the device or estimated from FLOPs and bytes moved (:mod:`.costs`); library kernels'
scratch space measured on the device whatever times the ops (:mod:`.kernels`).
"""
