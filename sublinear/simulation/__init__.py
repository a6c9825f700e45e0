"""Simulate: the peak memory and step time of one training step under any plan, torch-free.

- :mod:`.timeline`: :func:`~sublinear.simulation.timeline.simulate` walks the step's memory slots (forward,
  recompute, backward, FSDP's gather and reduce-scatter, the other graphs of the call) from the profile and the
  plan's analysis; :func:`~sublinear.simulation.timeline.step_terms` holds the plan-independent terms that the
  optimal planner's bounds use too.
- :mod:`.lifetimes`: where each slot is, the re-run copies a plan makes, and the slot after which each storage is
  released (:func:`~sublinear.simulation.lifetimes.lifetimes`), which the timeline counts bytes over.
- :mod:`.flat`: :class:`~sublinear.simulation.flat.FlatModel`, the same timeline for plans without soft split
  points, per block: exact recompute seconds and a peak bound (exact on chains), which the optimal planner searches.
"""
