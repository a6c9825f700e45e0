"""Memory of a compiled step as inductor's Python wrappers run it: every buffer they allocate and free, in order.

Inductor generates one ``call(args)`` function per graph that allocates each buffer (``empty_strided_*``, or a
library kernel that returns new tensors), aliases buffers (``reinterpret_tensor``, a buffer written in place of a
dead one), and frees each with ``del`` after its last use. :func:`parse_wrapper` reads those statements;
:class:`StepWalk` runs the forward's and then the backward's statements over one set of storages, so that what
forward returns for backward (a saved activation, or a copy of a parameter in another layout) is one storage in
both. Library kernels (matrix products, convolutions, attention) allocate scratch space inside the call that no
statement shows: a walk is given each call's transient bytes (:func:`library_calls` lists the calls).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["CallMemory", "Layout", "LibraryCall", "Statement", "StepWalk", "WalkResult", "library_calls",
           "parse_wrapper"]

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_UNPACK = re.compile(r"([\w\s,]+?),?\s*= args$")
_ALLOC = re.compile(r"(\w+) = empty_strided_\w+\((.*)\)$")
_MOVE = re.compile(r"(\w+) = (\w+); del (\w+)$")
_ASSIGN = re.compile(r"(\w+) = ([A-Za-z_]\w*)$")
_VIEW = re.compile(r"(\w+) = reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"(\w+) = (\w+)\[(\d+)\]$")
_LIBRARY = re.compile(r"(?:(\w+) = )?((?:extern_kernels\.\w+|torch\.ops\.[\w.]+)\(.*\))$")
_CHECK = re.compile(r"assert_size_stride\((\w+), (.*)\)$")
_SIZE_VAR = re.compile(r"(\w+) = ([\w\s+*/%()-]+)$")
_DTYPE = re.compile(r"torch\.(\w+)")
_DEL = re.compile(r"del (\w+)$")
_RETURN = re.compile(r"return \((.*)\)$")
RETURNED = "<returned>"  # the holder of what a graph returned
CALLER = "<caller>"  # the holder of what the step's caller holds (parameters, inputs)
_SOURCE_NODES = re.compile(r"# (Topologically Sorted|Unsorted) Source Nodes: \[(.*?)\]")


@dataclass(frozen=True)
class Statement:
    """One wrapper statement that changes what is live: ``kind`` is one of ``unpack`` (the arguments, ``names``),
    ``allocate`` (``name``: a buffer of ``shape``/``stride``/``dtype``), ``alias`` (``name`` shares ``base``'s
    storage), ``move`` (``name`` takes ``base``'s storage and ``base`` is dropped), ``item`` (``name`` is element
    ``index`` of ``base``, a library call's result tuple), ``assign`` (``name`` is ``base`` itself: the same tensor,
    layout included, or the same size value), ``call`` (a library kernel: ``call``, its result
    ``name`` or None), ``check`` (the shape and stride of ``name``, a library result the first time), ``free``,
    ``size`` (a size variable ``name`` = ``text``) and ``return`` (``names``: each returned value's base name, or
    None)."""

    kind: str
    name: str = ""
    base: str = ""
    shape: tuple = ()
    stride: tuple = ()
    dtype: str = ""
    index: int = 0
    names: tuple = ()
    text: str = ""
    call: LibraryCall | None = None


@dataclass(frozen=True)
class LibraryCall:
    """A library kernel the wrapper calls: its source text, and the captured graph's nodes it computes (the wrapper's
    comment: topologically sorted, the last is the kernel's own node; unsorted where they come from more than one
    graph, and then the own node is unknown)."""

    text: str
    source_nodes: tuple[str, ...]
    ordered: bool = True

    @property
    def node(self) -> str:
        return self.source_nodes[-1] if self.source_nodes and self.ordered else ""


def parse_wrapper(source: str) -> list[Statement] | None:
    """The statements of ``source``'s ``call`` function that change what is live, or None when the code is not in the
    form this reads (a C++ wrapper, or a nested function)."""
    start_at = source.find("def call(")
    if start_at < 0:
        return None
    statements: list[Statement] = []
    comment: tuple[tuple[str, ...], bool] = ((), True)
    for line in source[start_at:].splitlines()[1:]:
        text = line.strip()
        if nodes := _SOURCE_NODES.match(text):
            comment = (tuple(n.strip() for n in nodes.group(2).split(",") if n.strip()),
                       nodes.group(1) == "Topologically Sorted")
            continue
        text = re.sub(r"\s+#.*$", "", text)
        if not text or text.startswith("#"):
            continue
        if text.startswith("def "):
            return None
        statement = _statement(text, comment)
        if statement is not None:
            if statement.kind == "call":
                comment = ((), True)
            statements.append(statement)
            if statement.kind == "return":
                break
    return statements


def _statement(text: str, comment: tuple[tuple[str, ...], bool]) -> Statement | None:
    if match := _UNPACK.match(text):
        return Statement("unpack", names=tuple(n.strip() for n in match.group(1).split(",") if n.strip()))
    if match := _ALLOC.match(text):
        name, arguments = match.groups()
        call = ast.parse(f"f({arguments})", mode="eval").body
        dtype = _DTYPE.search(arguments.rsplit(",", 1)[-1])
        return Statement("allocate", name=name, shape=tuple(call.args[0].elts), stride=tuple(call.args[1].elts),
                         dtype=dtype.group(1) if dtype else "")
    if match := _MOVE.match(text):
        return Statement("move", name=match.group(1), base=match.group(2))
    if match := _VIEW.match(text):
        name, base = match.groups()
        if "; del " in text:
            return Statement("move", name=name, base=base) if text.rsplit("; del ", 1)[1].split()[0] == base else \
                Statement("alias", name=name, base=base)
        return Statement("alias", name=name, base=base)
    if match := _ASSIGN.match(text):
        return Statement("assign", name=match.group(1), base=match.group(2))
    if match := _ITEM.match(text):
        return Statement("item", name=match.group(1), base=match.group(2), index=int(match.group(3)))
    if match := _LIBRARY.match(text):
        return Statement("call", name=match.group(1) or "", call=LibraryCall(match.group(2), *comment))
    if match := _CHECK.match(text):
        call = ast.parse(f"f({match.group(2)})", mode="eval").body
        return Statement("check", name=match.group(1), shape=tuple(call.args[0].elts),
                         stride=tuple(call.args[1].elts))
    if match := _DEL.match(text):
        return Statement("free", name=match.group(1))
    if match := _RETURN.match(text):
        return Statement("return", names=tuple(_returned_base(e) for e in _elements(match.group(1))))
    if match := _SIZE_VAR.match(text):
        return Statement("size", name=match.group(1), text=match.group(2))
    return None


def _elements(text: str) -> list[ast.expr]:
    text = text.strip().rstrip(",")
    if not text:
        return []
    node = ast.parse(f"({text},)", mode="eval").body
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def _returned_base(element: ast.expr) -> str | None:
    """The buffer or argument a returned value is (directly, or through ``reinterpret_tensor``)."""
    if isinstance(element, ast.Name):
        return element.id
    if isinstance(element, ast.Call) and isinstance(element.func, ast.Name) and \
            element.func.id == "reinterpret_tensor" and element.args and isinstance(element.args[0], ast.Name):
        return element.args[0].id
    return None


def library_calls(statements: Sequence[Statement]) -> list[LibraryCall]:
    return [s.call for s in statements if s.kind == "call" and s.call is not None]


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
               ast.Mod: operator.mod}
_FUNCTIONS = {"max": max, "min": min}


def integer(node: ast.expr, sizes: Mapping[str, int]) -> int:
    """The value of a size expression the wrapper writes (integers, size symbols, arithmetic, max and min)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](integer(node.left, sizes), integer(node.right, sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -integer(node.operand, sizes)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        return _FUNCTIONS[node.func.id](*(integer(a, sizes) for a in node.args))
    raise ValueError(f"not a size: {ast.unparse(node)}")


def span_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes a strided layout covers."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * abs(t) for s, t in zip(shape, stride))) * itemsize


@dataclass(frozen=True)
class Layout:
    """A tensor's shape, stride and dtype name, as the wrapper states them."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return span_bytes(self.shape, self.stride, self.itemsize)


@dataclass(frozen=True)
class CallMemory:
    """What a library call holds inside itself beyond what is live before it (``inside_peak``: its results, scratch
    space), and the dtype of each tensor it returns."""

    inside_peak: int
    result_dtypes: tuple[str, ...] = ()


@dataclass
class WalkResult:
    """What one graph's walk saw: the bytes live at its start, at its peak (with the peak's statement), and at its
    end; the storages it returned, in order (None for values that are not tensors of the walk), and their layouts."""

    start: int
    peak: int
    end: int
    peak_at: str
    returned: list[int | None] = field(default_factory=list)
    returned_layouts: list[Layout | None] = field(default_factory=list)


CallMeasure = Callable[[LibraryCall, Mapping[str, Layout]], CallMemory]


class HeldStorages:
    """Storages and their holders: a storage counts in ``live`` from its making while any holder holds it."""

    def __init__(self) -> None:
        self.nbytes: dict[int, int] = {}
        self.holders: dict[int, set[str]] = {}
        self.live = 0
        self._next = 0

    def storage(self, nbytes: int, holder: str = CALLER) -> int:
        """A new storage of ``nbytes``, live from now on, held by ``holder``."""
        key = self._next
        self._next += 1
        self.nbytes[key] = nbytes
        self.holders[key] = {holder}
        self.live += nbytes
        return key

    def release(self, key: int, holder: str) -> None:
        holders = self.holders.get(key)
        if holders is not None and holder in holders:
            holders.discard(holder)
            if not holders:
                self.live -= self.nbytes[key]


class StepWalk(HeldStorages):
    """The storages live through one training step's compiled graphs. The caller makes the storages of the step's
    arguments (:meth:`storage`): those it holds (parameters, the step's inputs) are never freed by a ``del``; each
    graph's walk (:meth:`walk`) binds its arguments to storages. A storage lives while any holder (a name of the
    wrapper, a library call's result tuple, the caller, what a graph returned to) holds it. ``measure`` says what a
    library call holds inside itself (measured on the device); without it, calls hold nothing beyond their results."""

    def __init__(self, sizes: Mapping[str, int] | None = None, measure: CallMeasure | None = None,
                 listener: Callable[[Statement, int], None] | None = None) -> None:
        super().__init__()
        self.sizes = dict(sizes or {})
        self.measure = measure
        self.listener = listener  # told the bytes live at each statement (a library call's inside included)
        self._names: dict[str, int] = {}  # a wrapper name -> its storage
        self._tuples: dict[str, dict[int, int]] = {}  # a library call's result tuple -> its elements' storages
        self._layouts: dict[str, Layout] = {}
        self._results: dict[str, dict[int, tuple[tuple, tuple]]] = {}

    def walk(self, statements: Sequence[Statement], arguments: Sequence[tuple[int | None, Layout | None]],
             handed_over: Sequence[int] = ()) -> WalkResult:
        """Run one graph: its unpacked arguments bound, in order, to ``arguments`` ((storage or None, layout));
        storages in ``handed_over`` (what forward returned for backward, the gradients autograd hands it) are the
        graph's to free. Storages the graph returns stay live, held by what it returned to; the rest it frees."""
        self._names, self._tuples, self._layouts = {}, {}, {}
        self._results = _call_results(statements)
        start = peak = self.live
        peak_at, returned, layouts = "start", [], []
        for statement in statements:
            if statement.kind == "unpack":
                self._bind(statement.names, arguments, handed_over)
            elif statement.kind == "return":
                returned = [self._names.get(n) if n else None for n in statement.names]
                layouts = [self._layouts.get(n) if n else None for n in statement.names]
                for key in returned:
                    if key is not None:
                        self.holders[key].add(RETURNED)
                for name in [*self._names, *self._tuples]:
                    self._drop(name)
                break
            else:
                inside = self._apply(statement)
                if self.listener is not None:
                    self.listener(statement, self.live + inside)
                if self.live + inside > peak:
                    peak, peak_at = self.live + inside, statement.name or statement.kind
        return WalkResult(start, peak, self.live, peak_at, returned, layouts)

    def _bind(self, names: Sequence[str], arguments: Sequence[tuple[int | None, Layout | None]],
              handed_over: Sequence[int]) -> None:
        for name, (key, layout) in zip(names, arguments):
            if layout is not None:
                self._layouts[name] = layout
            if key is not None:
                self._hold(name, key)
        for key in handed_over:
            self.release(key, RETURNED)

    def _hold(self, name: str, key: int) -> None:
        self.holders[key].add(name)
        self._names[name] = key

    def _drop(self, name: str) -> None:
        key = self._names.pop(name, None)
        if key is not None:
            self.release(key, name)
        for element in self._tuples.pop(name, {}).values():
            self.release(element, name)

    def _apply(self, statement: Statement) -> int:
        """Apply one statement; the bytes a library call holds inside itself (0 for every other statement)."""
        kind, name = statement.kind, statement.name
        if kind == "allocate":
            if statement.dtype not in _DTYPE_BYTES:
                raise ValueError(f"unknown dtype {statement.dtype} in the wrapper")
            layout = self._layout(statement.shape, statement.stride, statement.dtype)
            self._layouts[name] = layout
            self._names[name] = self.storage(layout.nbytes, name)
        elif kind in ("alias", "move"):
            key = self._names.get(statement.base)
            if statement.base in self._layouts and kind == "move":
                self._layouts[name] = self._layouts[statement.base]
            if key is not None:
                self._hold(name, key)
            if kind == "move":
                self._drop(statement.base)
        elif kind == "assign":
            if statement.base in self._names:
                self._hold(name, self._names[statement.base])
                if statement.base in self._layouts:
                    self._layouts[name] = self._layouts[statement.base]
            elif statement.base in self._tuples:
                self._tuples[name] = dict(self._tuples[statement.base])
                for key in self._tuples[name].values():
                    self.holders[key].add(name)
            elif statement.base in self.sizes:
                self.sizes[name] = self.sizes[statement.base]
        elif kind == "item":
            key = self._tuples.get(statement.base, {}).get(statement.index)
            if key is not None:
                self._hold(name, key)
        elif kind == "call":
            memory = self.measure(statement.call, self._layouts) if self.measure else CallMemory(0)
            before = self.live
            if name:
                self._made(name, memory.result_dtypes)
            return max(0, before + memory.inside_peak - self.live)  # the results are inside the call's peak
        elif kind == "check" and name in self._layouts:
            self._layouts[name] = self._layout(statement.shape, statement.stride, self._layouts[name].dtype)
        elif kind == "free":
            self._drop(name)
        elif kind == "size" and name not in self._names:
            try:  # a size the wrapper computes from the size symbols (``ks0 = 16*s0``)
                self.sizes[name] = integer(ast.parse(statement.text, mode="eval").body, self.sizes)
            except (KeyError, ValueError, SyntaxError, ZeroDivisionError):
                pass
        return 0

    def _made(self, name: str, dtypes: tuple[str, ...]) -> None:
        """A library call's results, allocated by the call: one tensor (``name``), or a tuple whose elements the
        wrapper takes out later (``name[k]``): the tuple holds every element until it is deleted."""
        results = self._results.get(name, {})
        fallback = _first_dtype(self._layouts)
        if set(results) == {SINGLE}:
            shape, stride = results[SINGLE]
            layout = self._layout(shape, stride, dtypes[0] if dtypes else fallback)
            self._layouts[name] = layout
            self._names[name] = self.storage(layout.nbytes, name)
            return
        elements = {}
        for index, (shape, stride) in sorted(results.items()):
            layout = self._layout(shape, stride, dtypes[index] if index < len(dtypes) and dtypes[index] else fallback)
            elements[index] = self.storage(layout.nbytes, name)
        self._tuples[name] = elements

    def _layout(self, shape: tuple, stride: tuple, dtype: str) -> Layout:
        return Layout(tuple(integer(e, self.sizes) for e in shape), tuple(integer(e, self.sizes) for e in stride),
                      dtype)


SINGLE = -1  # the position of a library call's result that is one tensor, not a tuple


def _call_results(statements: Sequence[Statement]) -> dict[str, dict[int, tuple[tuple, tuple]]]:
    """Per library call's result name: the shape and stride of each tensor it returns, from the size checks the
    wrapper makes of it or of a name assigned it (``SINGLE``: the result itself; ``k``: element ``k`` of its tuple,
    checked where the wrapper takes it out, which may be long after the call)."""
    calls = {s.name: s.name for s in statements if s.kind == "call" and s.name}
    for s in statements:  # a fallback kernel's result is checked under a new name: ``buf38 = buf37``
        if s.kind == "assign" and s.base in calls:
            calls[s.name] = calls[s.base]
    element_of = {s.name: (calls[s.base], s.index) for s in statements if s.kind == "item" and s.base in calls}
    results: dict[str, dict[int, tuple[tuple, tuple]]] = {}
    for s in statements:
        if s.kind != "check":
            continue
        if s.name in calls:
            results.setdefault(calls[s.name], {}).setdefault(SINGLE, (s.shape, s.stride))
        elif s.name in element_of:
            call, index = element_of[s.name]
            results.setdefault(call, {}).setdefault(index, (s.shape, s.stride))
    return results


def _first_dtype(layouts: Mapping[str, Layout]) -> str:
    """A library result's dtype when no measurement says: the floating dtype the graph works in."""
    return next((layout.dtype for layout in layouts.values() if layout.dtype.startswith(("float", "bfloat"))),
                "float32")
