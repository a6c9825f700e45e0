"""Memory of a compiled graph as inductor's Python wrapper runs it: every buffer it allocates and frees, in order.

Inductor generates one ``call(args)`` function per graph that allocates each buffer (``empty_strided_*``, or a
library kernel that returns a new tensor), aliases buffers (``reinterpret_tensor``, a buffer written in place of a
dead one), and frees each with ``del`` after its last use. Walking those statements with the inputs' sizes gives the
bytes the graph holds at every point: what its kernels, fusion and scheduling really keep, recompute included.
Library kernels' own scratch space is not in the wrapper and is not counted.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WrapperMemory", "walk_wrapper"]

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_ALLOC = re.compile(r"(\w+) = empty_strided_\w+\((.*)\)$")
_MOVE = re.compile(r"(\w+) = (\w+); del (\w+)")
_VIEW = re.compile(r"(\w+) = reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"(\w+) = (\w+)\[\d+\]$")
_CALL = re.compile(r"(\w+) = (?:extern_kernels\.\w+|torch\.ops\.[\w.]+)\((\w+)")
_SIZE = re.compile(r"assert_size_stride\((\w+), (.*)\)$")
_SIZE_VAR = re.compile(r"(\w+) = ([\w\s+*/%()-]+)$")
_DTYPE = re.compile(r"torch\.(\w+)")
_DEL = re.compile(r"del (\w+)$")


@dataclass(frozen=True)
class WrapperMemory:
    """Bytes a compiled graph holds (inputs included): at its start, at its peak, and when it returns."""

    start: int
    peak: int
    end: int


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
               ast.Mod: operator.mod}
_FUNCTIONS = {"max": max, "min": min}


def _integer(node: ast.expr, sizes: Mapping[str, int]) -> int:
    """The value of a size expression the wrapper writes (integers, size symbols, arithmetic, max and min)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_integer(node.left, sizes), _integer(node.right, sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_integer(node.operand, sizes)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        return _FUNCTIONS[node.func.id](*(_integer(a, sizes) for a in node.args))
    raise ValueError(f"not a size: {ast.unparse(node)}")


def _span(shape: list[int], stride: list[int], itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * abs(t) for s, t in zip(shape, stride))) * itemsize


def _shape_and_stride(arguments: str, sizes: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """The first two arguments of a call (a shape and a stride tuple), evaluated."""
    call = ast.parse(f"f({arguments})", mode="eval").body
    shape, stride = call.args[0], call.args[1]
    return [_integer(e, sizes) for e in shape.elts], [_integer(e, sizes) for e in stride.elts]


def walk_wrapper(source: str, inputs: dict[str, tuple[int, int]], held: frozenset[str] = frozenset(),
                 sizes: Mapping[str, int] | None = None) -> WrapperMemory | None:
    """Walk ``source``'s ``call`` function. ``inputs``: per argument name, (bytes it counts for, bytes per element);
    arguments that are not counted (parameters counted elsewhere) are left out; those in ``held`` are also held by
    the caller (parameters, the call's inputs), so the wrapper dropping them frees nothing. ``sizes``: the value of
    each size symbol of code compiled for every size (``s0``). None when the code is not in the form this reads (a
    C++ wrapper, or statements it does not know), so the caller falls back to its model."""
    start_at = source.find("def call(")
    if start_at < 0:
        return None
    storage: dict[str, int] = {}  # name -> storage id
    size: dict[int, int] = {}
    refs: dict[int, set[str]] = {}
    itemsize: dict[str, int] = {}
    pending: dict[str, str] = {}  # results of library calls whose size comes with the next size check
    sizes = dict(sizes or {})
    live = 0
    counter = 0

    def new(name: str, nbytes: int) -> None:
        nonlocal live, counter
        storage[name] = counter
        size[counter] = nbytes
        refs[counter] = {name}
        live += nbytes
        counter += 1

    def alias(name: str, other: str) -> None:
        sid = storage.get(other)
        if sid is not None:
            storage[name] = sid
            refs[sid].add(name)
        if other in itemsize:
            itemsize[name] = itemsize[other]

    def drop(name: str) -> None:
        nonlocal live
        sid = storage.pop(name, None)
        if sid is None:
            return
        refs[sid].discard(name)
        if not refs[sid]:
            live -= size[sid]

    for name, (nbytes, element) in inputs.items():
        new(name, nbytes)
        itemsize[name] = element
        if name in held:
            refs[storage[name]].add("<caller>")
    start = peak = live
    for line in source[start_at:].splitlines()[1:]:
        text = re.sub(r"\s+#.*$", "", line.strip())
        if text.startswith("return"):
            break
        if text.startswith("def "):
            return None  # a nested function: not the flat wrapper this reads
        if match := _ALLOC.match(text):
            name, arguments = match.groups()
            dtype = _DTYPE.search(arguments.rsplit(",", 1)[-1])
            if dtype is None or dtype.group(1) not in _DTYPE_BYTES:
                return None
            itemsize[name] = _DTYPE_BYTES[dtype.group(1)]
            new(name, _span(*_shape_and_stride(arguments, sizes), itemsize[name]))
        elif match := _MOVE.match(text):
            alias(match.group(1), match.group(2))
            drop(match.group(3))
        elif match := _VIEW.match(text):
            alias(match.group(1), match.group(2))
            if "; del " in text:
                drop(text.rsplit("; del ", 1)[1].split()[0])
        elif match := _ITEM.match(text):
            pending[match.group(1)] = pending.get(match.group(2), match.group(2))
        elif match := _CALL.match(text):
            pending[match.group(1)] = match.group(2)
        elif (match := _SIZE.match(text)) and match.group(1) in pending:
            name = match.group(1)
            source_name = pending.pop(name)
            element = itemsize.get(source_name, 4)
            itemsize[name] = element
            new(name, _span(*_shape_and_stride(match.group(2), sizes), element))
        elif match := _DEL.match(text):
            drop(match.group(1))
        elif (match := _SIZE_VAR.match(text)) and match.group(1) not in storage:
            try:  # a size the wrapper computes from the size symbols (``ks0 = 16*s0``)
                sizes[match.group(1)] = _integer(ast.parse(match.group(2), mode="eval").body, sizes)
            except (KeyError, ValueError, SyntaxError, ZeroDivisionError):
                pass
        peak = max(peak, live)
    return WrapperMemory(start, peak, live)


def tensor_bytes(value) -> tuple[int, int]:
    """(storage bytes, bytes per element) of a tensor value (0 for anything else)."""
    import torch  # noqa: PLC0415

    if not isinstance(value, torch.Tensor):
        return 0, 0
    return hint(value.untyped_storage().nbytes()), value.element_size()


def hint(size) -> int:
    """An integer size; a symbolic size (traced for every size at once) at the size it was traced at."""
    import torch  # noqa: PLC0415

    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def ceil_to(nbytes: int, granule: int) -> int:
    return math.ceil(nbytes / granule) * granule if granule > 1 else nbytes
