"""Shape families: the sizes TorchDynamo left symbolic in a captured graph, and the sizes a plan is made for.

TorchDynamo captures a graph for the shapes of its first call. When a later call changes a size, it captures a
*dynamic* graph instead: the changed sizes become symbols (``s0``), passed to the graph as integer inputs, and that
one graph serves every later call whose guards pass. Its ops are the same at every size, so one plan (split points
over those ops) serves the whole family of shapes.

A plan is made for a *bound*: one value per symbol. The bytes of every storage are products and sums of sizes,
so they never shrink when a size grows; the simulated peak of a plan at the bound is therefore at least its peak
at every binding at or below it. A family's plan serves every call at or below its bound without profiling again.
The bound is the largest value seen of each symbol rounded up to a power of two (a size bucket), or the size the
config names for that input (``SublinearMemoryConfig.max_sizes``); a call beyond it plans again for a new bound.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from sublinear.tensors import stand_in_for_grad

__all__ = ["Binding", "SymbolicSizes", "argument_dims", "bucket", "covers", "describe_binding", "guards_hold", "join",
           "symbolic_sizes"]

Binding = dict[str, int]  # symbol name -> value

def bucket(binding: Mapping[str, int]) -> Binding:
    """Each value rounded up to the next power of two, at least 2 (a symbolic size is never 0 or 1)."""
    return {name: max(2, 1 << max(0, int(value) - 1).bit_length()) for name, value in binding.items()}


def covers(bound: Mapping[str, int], binding: Mapping[str, int]) -> bool:
    """Whether every value of ``binding`` is at most ``bound``'s."""
    return all(name in bound and value <= bound[name] for name, value in binding.items())


def join(a: Mapping[str, int], b: Mapping[str, int]) -> Binding:
    """The larger value of each symbol."""
    return {name: max(a.get(name, 0), b.get(name, 0)) for name in {*a, *b}}


def describe_binding(binding: Mapping[str, int]) -> str:
    return ", ".join(f"{name}<={value}" for name, value in sorted(binding.items()))


def _evaluate(expr: Any, binding: Mapping[str, int]) -> int:
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace({s: sympy.Integer(binding[s.name]) for s in expr.free_symbols}))


@dataclass(frozen=True)
class _SymbolicTensor:
    sizes: tuple[Any, ...]  # ints and sympy expressions
    strides: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    parameter: bool


@dataclass(frozen=True)
class SymbolicSizes:
    """The symbolic sizes of a dynamic graph's inputs, read off the placeholders TorchDynamo made
    (:func:`symbolic_sizes`).

    Symbols are renamed ``s0``, ``s1``, ... in the order the graph's inputs first use them (TorchDynamo numbers them
    per process), so every capture of a forward names them alike. ``inputs[i]`` is None for a placeholder with no
    symbolic size, the symbol's name for an integer input that is a symbol, and the tensor's symbolic sizes and
    strides otherwise. ``sources`` names, per symbol, the sizes of the call's arguments it stands for
    (``L['kwargs']['input_ids'].size()[1]``; sizes equal at capture share a symbol). ``renamed`` maps TorchDynamo's
    names to these. ``scalars`` are symbols that size nothing: integer inputs the graph only does arithmetic on (a
    call counter on the module); they change no storage, so plans are not made for their values.
    """

    inputs: tuple[str | _SymbolicTensor | None, ...]
    symbols: tuple[str, ...]
    sources: Mapping[str, tuple[str, ...]]
    renamed: Mapping[str, str]
    scalars: frozenset[str] = frozenset()

    def rename(self, code: str) -> str:
        """``code`` (the graph's Python code) with TorchDynamo's symbol names replaced by these."""
        return re.sub(r"\bs\d+\b", lambda m: self.renamed.get(m.group(0), m.group(0)), code)

    def sizing(self, binding: Mapping[str, int]) -> Binding:
        """``binding`` without the :attr:`scalars`: the values plans are made for."""
        return {name: value for name, value in binding.items() if name not in self.scalars}

    def binding(self, values: Sequence[Any]) -> Binding:
        """The value of every symbol in a call with ``values``."""
        found: Binding = {}
        for spec, value in zip(self.inputs, values):
            if isinstance(spec, str):
                found[spec] = int(value)
            elif isinstance(spec, _SymbolicTensor):
                for s, n in zip(spec.sizes, value.shape):
                    if isinstance(s, sympy.Symbol):
                        found[s.name] = int(n)
        return found

    def masked(self, index: int, value: torch.Tensor) -> tuple[tuple, tuple]:
        """The shape and stride of input ``index`` with symbolic sizes as their expressions (a family's key)."""
        spec = self.inputs[index]
        if not isinstance(spec, _SymbolicTensor):
            return tuple(value.shape), tuple(value.stride())

        def mask(exprs: tuple[Any, ...], actual: Sequence[int]) -> tuple:
            return tuple(str(e) if not isinstance(e, int) else int(n) for e, n in zip(exprs, actual))

        return mask(spec.sizes, value.shape), mask(spec.strides, value.stride())

    def stand_ins(self, values: Sequence[Any], binding: Mapping[str, int]) -> list[Any]:
        """``values`` with every input that has symbolic sizes replaced by a data-less stand-in at ``binding``
        (fake tensors of the same dtype, device and requires_grad), for profiling at sizes no call had."""
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        out: list[Any] = []
        for spec, value in zip(self.inputs, values):
            if isinstance(spec, str):
                out.append(binding.get(spec, value))
            elif isinstance(spec, _SymbolicTensor):
                with mode:
                    t = torch.empty_strided([_evaluate(s, binding) for s in spec.sizes],
                                            [_evaluate(s, binding) for s in spec.strides], dtype=spec.dtype,
                                            device=value.device)
                    out.append(torch.nn.Parameter(t, spec.requires_grad) if spec.parameter
                               else stand_in_for_grad(t, value))
            else:
                out.append(value)
        return out

    def symbolic_inputs(self, values: Sequence[Any], binding: Mapping[str, int]) -> tuple[list[Any], dict[str, str]]:
        """Fake inputs whose symbolic sizes are symbols of a fresh shape environment, each hinted at ``binding``
        (AOTAutograd and inductor then trace and compile the graph for every size at once), other inputs as
        data-less fakes of ``values``; and the environment's name of each symbol -> the family's name. Every symbol
        stays its own, whatever its hint (no duck sizing: two sizes equal at the bound need not be equal later).
        The environment's guards (``torch._guards.detect_fake_mode(inputs).shape_env.guards``) say which sizes the
        code compiled from these inputs serves."""
        from torch._dynamo.source import ConstantSource  # noqa: PLC0415
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv  # noqa: PLC0415

        env = ShapeEnv(duck_shape=False)
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
        symbols: dict[str, torch.SymInt] = {}
        renamed: dict[str, str] = {}
        hints = {**{spec: max(2, int(value)) for spec, value in zip(self.inputs, values) if isinstance(spec, str)},
                 **binding}  # a scalar is hinted at its value (at least 2: 0 and 1 are constants to the environment)
        for name in self.symbols:
            symbol = env.create_symbol(hints[name], ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
            symbols[name] = env.create_symintnode(symbol, hint=hints[name])
            renamed[symbol.name] = name

        def size(expr: Any) -> Any:
            return expr if isinstance(expr, int) else _sym_expr(expr, symbols)

        out: list[Any] = []
        for spec, value in zip(self.inputs, values):
            if isinstance(spec, str):
                out.append(symbols[spec])
                continue
            if isinstance(spec, _SymbolicTensor):
                shape, stride = [size(s) for s in spec.sizes], [size(s) for s in spec.strides]
                dtype, requires_grad, parameter = spec.dtype, spec.requires_grad, spec.parameter
            elif isinstance(value, torch.Tensor):
                shape, stride = list(value.shape), list(value.stride())
                dtype, requires_grad = value.dtype, value.requires_grad
                parameter = isinstance(value, torch.nn.Parameter)
            else:
                out.append(value)
                continue
            with mode:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=value.device)
                out.append(torch.nn.Parameter(t, requires_grad) if parameter
                           else stand_in_for_grad(t, value))
        return out, renamed


def symbolic_sizes(gm: fx.GraphModule) -> SymbolicSizes | None:
    """The graph's symbolic sizes; None for a graph whose every size is static, or whose symbols cannot all be
    read from its inputs' values (it is then planned per exact shape)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    values = [node.meta.get("example_value", node.meta.get("val")) for node in placeholders]
    renamed: dict[sympy.Symbol, sympy.Symbol] = {}
    sources: dict[str, tuple[str, ...]] = {}

    def canonical(expr: Any) -> Any:
        if isinstance(expr, int):
            return expr
        for symbol in sorted(expr.free_symbols, key=lambda sym: sym.name):
            if symbol not in renamed:
                renamed[symbol] = sympy.Symbol(f"s{len(renamed)}", integer=True, positive=True)
        return expr.xreplace(renamed)

    inputs: list[str | _SymbolicTensor | None] = []
    readable: set[str] = set()
    arithmetic_only: set[str] = set()
    sizing: set[str] = set()
    for node, value in zip(placeholders, values):
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if not isinstance(expr, sympy.Symbol):
                return None
            name = canonical(expr).name
            inputs.append(name)
            readable.add(name)
            if _arithmetic_only(node):
                arithmetic_only.add(name)
            known = value.node.shape_env.var_to_sources.get(expr, ())
            sources[name] = tuple(dict.fromkeys(source.name for source in known))
        elif isinstance(value, torch.Tensor) and _symbolic(value):
            sizes = tuple(canonical(_expr(s)) for s in value.shape)
            strides = tuple(canonical(_expr(s)) for s in value.stride())
            if not all(_rebuildable(e) for e in (*sizes, *strides)):
                return None
            readable.update(e.name for e in sizes if isinstance(e, sympy.Symbol))
            sizing.update(sym.name for e in (*sizes, *strides) if not isinstance(e, int) for sym in e.free_symbols)
            inputs.append(_SymbolicTensor(sizes, strides, value.dtype, value.device, value.requires_grad,
                                          isinstance(value, torch.nn.Parameter)))
        else:
            inputs.append(None)
    symbols = tuple(symbol.name for symbol in renamed.values())
    if not symbols or not set(symbols) <= readable:
        return None
    return SymbolicSizes(tuple(inputs), symbols, sources, {old.name: new.name for old, new in renamed.items()},
                         frozenset(arithmetic_only - sizing))


_ARGUMENT_SIZE = re.compile(r"^L\[(?:'args'\]\[(\d+)|'kwargs'\]\['(\w+)'|'(\w+)')\]\.size\(\)\[(\d+)\]$")


def argument_dims(sources: Sequence[str], positional: Sequence[str]) -> list[tuple[str, int]]:
    """The (argument name, dimension) pairs among ``sources`` that size an argument of the call itself (not a tensor
    reached through one); ``positional`` names the call's positional parameters in order."""
    found = []
    for source in sources:
        match = _ARGUMENT_SIZE.match(source)
        if match is None:
            continue
        index, keyword, local, dim = match.groups()
        if index is not None:
            if int(index) >= len(positional):
                continue
            name = positional[int(index)]
        else:
            name = keyword or local
        found.append((name, int(dim)))
    return found


def _arithmetic_only(placeholder: fx.Node) -> bool:
    """Whether the graph only does Python arithmetic on ``placeholder`` (an integer input), down to its outputs."""
    pending = list(placeholder.users)
    while pending:
        node = pending.pop()
        if node.op == "output":
            continue
        if node.op != "call_function" or getattr(node.target, "__module__", None) not in ("_operator", "operator"):
            return False
        pending.extend(node.users)
    return True


def guards_hold(guards: Sequence[Any], binding: Mapping[str, int]) -> bool:
    """Whether every guard expression (sympy, over symbol names of ``binding``) holds at ``binding``."""
    for expr in guards:
        value = expr.xreplace({s: sympy.Integer(binding[s.name]) for s in expr.free_symbols if s.name in binding})
        if value.free_symbols or not bool(value):
            return False
    return True


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _expr(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(size)


_BUILDERS = ((sympy.Add, lambda a, b: a + b), (sympy.Mul, lambda a, b: a * b),
             (sympy.Max, lambda a, b: torch.sym_max(a, b)), (sympy.Min, lambda a, b: torch.sym_min(a, b)))


def _rebuildable(expr: Any) -> bool:
    """Whether ``expr`` is integers and symbols under sums, products, maxima and minima."""
    if isinstance(expr, int) or expr.is_Integer or isinstance(expr, sympy.Symbol):
        return True
    return any(isinstance(expr, kind) for kind, _ in _BUILDERS) and all(_rebuildable(a) for a in expr.args)


def _sym_expr(expr: Any, symbols: Mapping[str, torch.SymInt]) -> Any:
    """A SymInt for a sympy expression over ``symbols`` (see :func:`_rebuildable`)."""
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return symbols[expr.name]
    combine = next(f for kind, f in _BUILDERS if isinstance(expr, kind))
    parts = [_sym_expr(a, symbols) for a in expr.args]
    total = parts[0]
    for p in parts[1:]:
        total = combine(total, p)
    return total
