"""Execute: run a captured graph under a plan.

- :mod:`.compiled`: the default; the plan is AOTAutograd's partition and inductor compiles forward and backward,
  recompute included.
- :mod:`.eager`: sublinear's eager executor (:func:`~sublinear.execute.eager.rewrite`), for debugging and where
  inductor cannot run: the forward stores what the plan keeps and rebuilds the rest in backward, block by block.
- :mod:`.program`: a graph's nodes as straight-line Python, which the eager executor runs.
"""
