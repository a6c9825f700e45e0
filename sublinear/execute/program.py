"""A lean node-by-node executor for fx graphs, shared by the profiler and the cost measurement, and the source of
the rewriter's generated code (:meth:`NodeProgram.expression`).

Values live in a list indexed by node position and are dropped right after their last use, exactly as fx's
generated code does, so memory behaves as in eager execution of the same graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx
from torch.fx.node import Node, map_arg

from sublinear.capture.dynamo import describe_node, module_path
from sublinear.execute.functions import AUTOGRAD_FUNCTION_APPLY, apply_function

__all__ = ["NodeProgram", "OPERATOR_KINDS"]

OPERATOR_KINDS = ("call_function", "call_method", "call_module")


class NodeProgram:
    """Executable form of ``graph_module``'s graph.

    ``get_attr``/``call_module`` targets resolve against ``graph_module`` (constants and subgraphs that capture
    created; parameters and buffers are placeholders).
    """

    def __init__(self, graph_module: fx.GraphModule) -> None:
        self.graph_module = graph_module
        self.nodes: list[Node] = list(graph_module.graph.nodes)
        self.index: dict[Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [i for i, n in enumerate(self.nodes) if n.op == "placeholder"]
        self.output = next(i for i, n in enumerate(self.nodes) if n.op == "output")
        self.operators = [i for i, n in enumerate(self.nodes) if n.op in OPERATOR_KINDS]
        self.inputs: list[list[int]] = [[self.index[a] for a in n.all_input_nodes] for n in self.nodes]
        self.users: list[list[int]] = [sorted(self.index[u] for u in n.users) for n in self.nodes]
        self.frees_after = _frees_after(self.nodes, self.inputs, self.output)
        self._steps = [_step(n, self.index, graph_module) for n in self.nodes]
        self.namespace: dict[str, Any] = {}  # objects that generated code names (see expression)
        self._names: dict[int, str] = {}

    def describe(self, i: int, with_line: bool = True) -> str:
        """Where node ``i`` comes from in the user's model: module path, node name and (optionally) source line."""
        node = self.nodes[i]
        if with_line:
            return describe_node(node)
        path = module_path(node) or (str(node.target) if node.op == "call_module" else "")
        return f"{path} ({node.name})" if path else node.name

    def operation(self, i: int) -> str:
        """What node ``i`` calls (its kind and target), the same in every process."""
        node = self.nodes[i]
        target = node.target if isinstance(node.target, str) else \
            f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__qualname__', node.target)}"
        return f"{node.op}:{target}"

    def run_node(self, i: int, env: list[Any]) -> Any:
        """Execute node ``i`` reading its inputs from ``env``."""
        return self._steps[i](env)

    def arguments(self, i: int, env: list[Any]) -> tuple[tuple, dict]:
        """Node ``i``'s args and kwargs, read from ``env``."""
        node = self.nodes[i]
        args = tuple(map_arg(node.args, lambda n: env[self.index[n]]))
        kwargs = dict(map_arg(node.kwargs, lambda n: env[self.index[n]]))
        return args, kwargs

    def call(self, i: int, args: tuple, kwargs: dict) -> Any:
        """Run node ``i``'s operation on the given args and kwargs."""
        node = self.nodes[i]
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return getattr(*_resolve(self.graph_module, node.target))(*args, **kwargs)
        if node.op == "get_attr":
            return getattr(*_resolve(self.graph_module, node.target))
        return _eager(node.target)(*args, **kwargs)

    def run(self, placeholder_values: list[Any],
            after: Callable[[int, Any], None] | None = None,
            before: Callable[[int, list[Any]], None] | None = None) -> Any:
        """Run the whole graph; return the output node's value."""
        if len(placeholder_values) != len(self.placeholders):
            raise TypeError(f"graph takes {len(self.placeholders)} inputs, got {len(placeholder_values)}")
        env: list[Any] = [None] * len(self.nodes)
        for i, value in zip(self.placeholders, placeholder_values):
            env[i] = value
        steps, frees = self._steps, self.frees_after
        for i in range(len(self.nodes)):
            if i == self.output:
                return steps[i](env)
            if self.nodes[i].op == "placeholder":
                continue
            if before is not None:
                before(i, env)
            env[i] = steps[i](env)
            if after is not None:
                after(i, env[i])
            for j in frees[i]:
                env[j] = None
        raise AssertionError("graph has no output node")

    # -- generated code ----------------------------------------------------------------------------------------

    def expression(self, i: int) -> str:
        """Python source computing node ``i`` from locals ``v<j>`` (node j's value), with its function, module and
        constants named in :attr:`namespace`; exec it with :meth:`define`."""
        node = self.nodes[i]
        if node.op == "output":
            return self._source(node.args[0])
        if node.op == "get_attr":
            owner = self.bind(_resolve(self.graph_module, node.target)[0])
            return f"getattr({owner}, {node.target.rsplit('.', 1)[-1]!r})"
        args = [self._source(a) for a in node.args]
        kwargs = [f"{k}={self._source(v)}" if k.isidentifier() else f"**{{{k!r}: {self._source(v)}}}"
                  for k, v in node.kwargs.items()]
        if node.op == "call_method":
            return f"{args[0]}.{node.target}({', '.join(args[1:] + kwargs)})"
        fn = getattr(*_resolve(self.graph_module, node.target)) if node.op == "call_module" else _eager(node.target)
        return f"{self.bind(fn)}({', '.join(args + kwargs)})"

    def source(self, name: str, node_lines: Callable[[int], list[str]] | None = None, first: str = "") -> str:
        """Python source of ``def name(<first>values)``: the graph as straight-line code, node j's value in local
        ``v<j>``, freed after its last use as in fx's generated code. ``node_lines(i)`` gives the indented lines
        that compute operator or get_attr node ``i`` (by default ``v<i> = <expression>``)."""
        lines = [f"def {name}({first}values):"]
        if self.placeholders:
            lines.append(f"    {''.join(f'v{i}, ' for i in self.placeholders)}= values")
        for i, node in enumerate(self.nodes):
            if node.op == "placeholder":
                continue
            if i == self.output:
                lines.append(f"    return {self.expression(i)}")
                break
            lines += node_lines(i) if node_lines is not None else [f"    v{i} = {self.expression(i)}"]
            lines += [f"    del v{j}" for j in self.frees_after[i]]
        return "\n".join(lines) + "\n"

    def define(self, name: str, source: str) -> Callable[..., Any]:
        """The function ``name`` that ``source`` (from :meth:`source`, or built from :meth:`expression`) defines."""
        scope = dict(self.namespace)
        exec(compile(source, f"<sublinear {name}>", "exec"), scope)  # noqa: S102 (source built from the graph)
        return scope[name]

    def _source(self, template: Any) -> str:
        if isinstance(template, Node):
            return f"v{self.index[template]}"
        if isinstance(template, tuple):
            return f"({''.join(self._source(a) + ', ' for a in template)})"
        if isinstance(template, list):
            return f"[{', '.join(self._source(a) for a in template)}]"
        if isinstance(template, dict):
            return f"{{{', '.join(f'{k!r}: {self._source(v)}' for k, v in template.items())}}}"
        if isinstance(template, slice):  # a dynamic graph's slice bounds are nodes (sizes)
            start, stop, step = (self._source(a) for a in (template.start, template.stop, template.step))
            return f"slice({start}, {stop}, {step})"
        if template is None or isinstance(template, (bool, int, str)):
            return repr(template)
        return self.bind(template)

    def bind(self, obj: Any) -> str:
        """A name in :attr:`namespace` bound to ``obj`` (one name per object)."""
        name = self._names.get(id(obj))
        if name is None:
            name = self._names[id(obj)] = f"_k{len(self._names)}"
            self.namespace[name] = obj
        return name


def _frees_after(nodes: list[Node], inputs: list[list[int]], output: int) -> list[list[int]]:
    """The values dropped right after each node runs: a value after its last reader (the output node's inputs are
    returned, never dropped), and a value nothing reads at once, as in fx's generated code."""
    last_use: dict[int, int] = {}
    for i, ins in enumerate(inputs):
        for j in ins:
            last_use[j] = i
    frees_after: list[list[int]] = [[] for _ in nodes]
    for j, i in last_use.items():
        if i != output:
            frees_after[i].append(j)
    for i, node in enumerate(nodes):
        if not node.users and node.op not in ("placeholder", "output"):
            frees_after[i].append(i)
    return frees_after


def _resolve(graph_module: fx.GraphModule, target: str) -> tuple[Any, str]:
    """(owner object, attribute name) for a dotted target of the graph module."""
    *path, name = target.split(".")
    owner = graph_module
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise AttributeError(f"graph target {target!r} not found on the graph module")
    return owner, name


def _step(node: Node, index: dict[Node, int], graph_module: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``node`` as a function of the value list (node j's value at position j)."""
    fetch = _fetcher(node.args, index)
    fetch_kwargs = _fetcher(node.kwargs, index) if node.kwargs else None
    if node.op == "placeholder":
        return lambda env, i=index[node]: env[i]
    if node.op == "output":
        return lambda env: fetch(env)[0]
    if node.op == "get_attr":
        owner, name = _resolve(graph_module, node.target)
        return lambda env: getattr(owner, name)
    if node.op == "call_module":
        owner, name = _resolve(graph_module, node.target)
        module = getattr(owner, name)
        fn: Callable[..., Any] = module
    elif node.op == "call_method":
        fn = _method_caller(node.target)
    else:
        fn = _eager(node.target)
    if fetch_kwargs is None:
        return lambda env: fn(*fetch(env))
    return lambda env: fn(*fetch(env), **fetch_kwargs(env))


def _eager(target: Any) -> Any:
    """What runs a call_function node's ``target`` eagerly: a captured ``autograd.Function`` frees what it saves
    as eager does (:mod:`.functions`); every other target is called as it is."""
    return apply_function if AUTOGRAD_FUNCTION_APPLY is not None and target is AUTOGRAD_FUNCTION_APPLY else target


def _fetcher(template: Any, index: dict[Node, int]) -> Callable[[list[Any]], Any]:
    if isinstance(template, tuple) and all(not isinstance(a, (tuple, list, dict, slice)) for a in template):
        refs = tuple((isinstance(a, Node), index[a] if isinstance(a, Node) else a) for a in template)
        return lambda env: tuple(env[v] if is_ref else v for is_ref, v in refs)
    return lambda env: map_arg(template, lambda n: env[index[n]])


def _method_caller(name: str) -> Callable[..., Any]:
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)
