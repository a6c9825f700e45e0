"""Capture: the user's forward as torch.fx graphs (:class:`~sublinear.capture.dynamo.CapturedGraph`).

- :mod:`.dynamo`: TorchDynamo as a ``torch.compile`` backend keeps Python's semantics (guards, side effects,
  ``autograd.Function``, graph breaks); each graph it hands over becomes a ``CapturedGraph``.
- :mod:`.shapes`: a dynamic graph's symbolic sizes (:class:`~sublinear.capture.shapes.SymbolicSizes`): one shape
  family, planned once for a bound and served below it.
"""
