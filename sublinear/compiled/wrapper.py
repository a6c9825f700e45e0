"""Memory of a compiled graph as inductor's Python wrapper runs it: every buffer it allocates and frees, in order.

Inductor generates one ``call(args)`` function per graph that allocates each buffer (``empty_strided_*``, or a
library kernel that returns a new tensor), aliases buffers (``reinterpret_tensor``, a buffer written in place of a
dead one), and frees each with ``del`` after its last use. Walking those statements with the inputs' sizes gives the
bytes the graph holds at every point: what its kernels, fusion and scheduling really keep, recompute included.
Library kernels' own scratch space is not in the wrapper and is not counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["WrapperMemory", "walk_wrapper"]

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_ALLOC = re.compile(r"(\w+) = empty_strided_\w+\(\((.*?)\), \((.*?)\), torch\.(\w+)\)")
_MOVE = re.compile(r"(\w+) = (\w+); del (\w+)")
_VIEW = re.compile(r"(\w+) = reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"(\w+) = (\w+)\[\d+\]$")
_CALL = re.compile(r"(\w+) = (?:extern_kernels\.\w+|torch\.ops\.[\w.]+)\((\w+)")
_SIZE = re.compile(r"assert_size_stride\((\w+), \((.*?)\), \((.*?)\)")
_DEL = re.compile(r"del (\w+)$")


@dataclass(frozen=True)
class WrapperMemory:
    """Bytes a compiled graph holds (inputs included): at its start, at its peak, and when it returns."""

    start: int
    peak: int
    end: int


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def _span(shape: list[int], stride: list[int], itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * abs(t) for s, t in zip(shape, stride))) * itemsize


def walk_wrapper(source: str, inputs: dict[str, tuple[int, int]], held: frozenset[str] = frozenset()) -> \
        WrapperMemory | None:
    """Walk ``source``'s ``call`` function. ``inputs``: per argument name, (bytes it counts for, bytes per element);
    arguments that are not counted (parameters counted elsewhere) are left out; those in ``held`` are also held by
    the caller (parameters, the call's inputs), so the wrapper dropping them frees nothing. None when the code is not
    in the form this reads (a C++ wrapper, or statements it does not know), so the caller falls back to its model."""
    start_at = source.find("def call(")
    if start_at < 0:
        return None
    storage: dict[str, int] = {}  # name -> storage id
    size: dict[int, int] = {}
    refs: dict[int, set[str]] = {}
    itemsize: dict[str, int] = {}
    pending: dict[str, str] = {}  # results of library calls whose size comes with the next size check
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
        text = line.strip()
        if text.startswith("return"):
            break
        if text.startswith("def "):
            return None  # a nested function: not the flat wrapper this reads
        if match := _ALLOC.match(text):
            name, shape, stride, dtype = match.groups()
            if dtype not in _DTYPE_BYTES:
                return None
            itemsize[name] = _DTYPE_BYTES[dtype]
            new(name, _span(_ints(shape), _ints(stride), itemsize[name]))
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
            new(name, _span(_ints(match.group(2)), _ints(match.group(3)), element))
        elif match := _DEL.match(text):
            drop(match.group(1))
        peak = max(peak, live)
    return WrapperMemory(start, peak, live)


def tensor_bytes(value) -> tuple[int, int]:
    """(storage bytes, bytes per element) of a tensor value (0 for anything else)."""
    import torch  # noqa: PLC0415

    if not isinstance(value, torch.Tensor):
        return 0, 0
    return value.untyped_storage().nbytes(), value.element_size()


def ceil_to(nbytes: int, granule: int) -> int:
    return math.ceil(nbytes / granule) * granule if granule > 1 else nbytes
