"""Capture: a module plus example inputs becomes one torch.fx GraphModule that shares the module's tensors.

Capture paths, tried in order:

1. ``torch.fx.symbolic_trace`` (shape-generic: the graph serves any batch size). Arguments the example does not
   give, and arguments that hold no tensor, are specialised to their value.
2. ``torch.export.export(strict=False)``: runs the Python code on fake tensors, so control flow on shapes, item
   assignment and iteration on tensors work. The graph is specialised to the example shapes.
3. ``torch.export.export(strict=True)``: TorchDynamo bytecode capture, same output form as 2.

The graph's ``get_attr``/``call_module`` targets resolve against the original module (see
:class:`sublinear.interpret.NodeProgram`), so parameters and buffers are the module's own objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

__all__ = ["CaptureError", "CapturedGraph", "InputSignature", "capture", "input_signature"]


class CaptureError(RuntimeError):
    """No capture path could turn the module into a graph; the message lists each path and its error."""


@dataclass(frozen=True)
class InputSignature:
    """Shapes, dtypes, devices and requires_grad of the tensor leaves of a call, plus its non-tensor leaves."""

    tensors: tuple[tuple[tuple[int, ...], torch.dtype, str, bool], ...]
    constants: tuple[str, ...]

    def describe(self) -> str:
        parts = [f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}@{dev}" for shape, dtype, dev, _ in self.tensors]
        return ", ".join(parts) or "no tensors"


def input_signature(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> InputSignature:
    tensors, constants = [], []
    for leaf in tree_leaves((tuple(args), dict(kwargs or {}))):
        if isinstance(leaf, torch.Tensor):
            tensors.append((tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        else:
            constants.append(repr(leaf))
    return InputSignature(tuple(tensors), tuple(constants))


@dataclass
class CapturedGraph:
    """A graph computing ``module(*args, **kwargs)``.

    Invariant: ``run`` of the graph on :meth:`placeholder_values` equals the module's forward on the same call,
    and every parameter or buffer the graph reads is the module's own object.
    """

    module: nn.Module
    graph_module: fx.GraphModule
    method: str
    signature: inspect.Signature
    example: InputSignature
    shape_generic: bool
    attempts: list[str] = field(default_factory=list)

    def placeholder_values(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Values for the graph's placeholders, in order, for a call ``module(*args, **kwargs)``."""
        positional = _normalise_call(self.signature, args, kwargs or {})
        return list(self.graph_module.graph._codegen.process_inputs(*positional))

    def outputs(self, value: Any) -> Any:
        """The module's return value from the value of the graph's output node."""
        return self.graph_module.graph._codegen.process_outputs(value)


def capture(module: nn.Module, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> CapturedGraph:
    """Capture ``module`` called as ``module(*args, **kwargs)``; raise :class:`CaptureError` if no path works."""
    kwargs = dict(kwargs or {})
    if not isinstance(module, nn.Module):
        raise TypeError(f"capture() needs an nn.Module, got {type(module).__name__}")
    signature = _forward_signature(module)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"example inputs do not match {type(module).__name__}.forward{signature}: {exc}. "
            "Pass example_inputs/example_kwargs as you would call the module."
        ) from None
    example = input_signature(args, kwargs)
    attempts: list[str] = []
    for method, fn in (("symbolic_trace", _symbolic_trace), ("export", _export_non_strict),
                       ("dynamo", _export_strict)):
        try:
            gm = fn(module, signature, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the user below
            attempts.append(f"{method}: {type(exc).__name__}: {_first_line(exc)}")
            continue
        return CapturedGraph(module, gm, method, signature, example, shape_generic=method == "symbolic_trace",
                             attempts=attempts)
    raise CaptureError(
        f"could not capture {type(module).__name__} with any capture path:\n  - " + "\n  - ".join(attempts)
        + "\nMake the failing code traceable (for example avoid data-dependent Python control flow on tensor "
          "values) or mark the offending submodule as a leaf."
    )


def _forward_signature(module: nn.Module) -> inspect.Signature:
    signature = inspect.signature(module.forward)
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{type(module).__name__}.forward takes *{p.name}; sublinear needs named parameters")
    return signature


def _normalise_call(signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """Every forward parameter as a positional value, defaults filled in."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"inputs do not match forward{signature}: {exc}") from None
    bound.apply_defaults()
    return tuple(bound.arguments[name] for name in signature.parameters)


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))


def _symbolic_trace(module, signature, args, kwargs) -> fx.GraphModule:
    bound = signature.bind(*args, **kwargs)
    concrete = {
        name: bound.arguments[name] if name in bound.arguments else param.default
        for name, param in signature.parameters.items()
        if name not in bound.arguments or not _holds_tensor(bound.arguments[name])
    }
    return fx.symbolic_trace(module, concrete_args=concrete or None)


def _export(module, signature, args, kwargs, strict: bool) -> fx.GraphModule:
    positional = _on_module_device(module, _normalise_call(signature, args, kwargs))
    program = torch.export.export(module, positional, strict=strict)
    return program.module()


def _on_module_device(module: nn.Module, values: tuple) -> tuple:
    """Meta example inputs for a module with real tensors: export propagates fake tensors and needs one device."""
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), None)
    if device is None or device.type == "meta":
        return values

    def materialise(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return torch.zeros(value.shape, dtype=value.dtype, device=device).requires_grad_(value.requires_grad)
        return value

    return tuple(torch.utils._pytree.tree_map(materialise, v) for v in values)


def _export_non_strict(module, signature, args, kwargs) -> fx.GraphModule:
    return _export(module, signature, args, kwargs, strict=False)


def _export_strict(module, signature, args, kwargs) -> fx.GraphModule:
    return _export(module, signature, args, kwargs, strict=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
