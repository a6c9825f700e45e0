"""Capture: the user's forward as torch.fx graphs (:class:`~sublinear.capture.dynamo.CapturedGraph`).

- :mod:`.dynamo`: TorchDynamo as a ``torch.compile`` backend keeps Python's semantics (guards, side effects,
  ``autograd.Function``, graph breaks); each graph it hands over becomes a ``CapturedGraph``.
- :mod:`.checkpoints`: ``torch.utils.checkpoint`` regions TorchDynamo hands over, inlined so that the plan decides
  what is recomputed.
- :mod:`.joint`: the joint forward+backward graph AOTAutograd traces from a captured graph, which the compiled
  front end profiles and the compiled executor partitions.
- :mod:`.attention`, :mod:`.lm_head`: rewrites of a captured graph that hold less whatever the plan: attention written
  out as its matrices computed by ``F.scaled_dot_product_attention``, an LM head and its cross-entropy in chunks.
- :mod:`.shapes`: a dynamic graph's symbolic sizes (:func:`~sublinear.capture.shapes.symbolic_sizes`): one shape
  family, planned once for a bound and served below it.
"""
