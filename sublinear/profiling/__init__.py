"""Profile: a captured graph's training step as a torch-free :class:`~sublinear.core.profile.GraphProfile`.

- :mod:`.graph`: :func:`~sublinear.profiling.graph.profile` runs the step once (fake, meta or real tensors) and
  groups nodes into ops with their storages, lifetimes, saved tensors and backward gradient side.
- :mod:`.tracking`: per-storage allocation tracking, so views and in-place ops alias.
- :mod:`.costs`: op times, measured on the device or estimated from FLOPs (``FlopCounterMode``) and bytes moved.
"""
