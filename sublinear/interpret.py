"""A lean node-by-node executor for fx graphs, shared by the profiler and the rewritten module.

Values live in a list indexed by node position and are dropped right after their last use, exactly as fx's
generated code does, so memory behaves as in eager execution of the same graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx, nn
from torch.fx.node import Node, map_arg

__all__ = ["NodeProgram", "OPERATOR_KINDS"]

OPERATOR_KINDS = ("call_function", "call_method", "call_module")


class NodeProgram:
    """Executable form of ``graph_module``'s graph.

    ``get_attr``/``call_module`` targets resolve against ``root`` when it has them (the user's module, so its
    parameters and buffers are read live at every call) and against ``graph_module`` otherwise (constants and
    helpers that capture created).
    """

    def __init__(self, graph_module: fx.GraphModule, root: nn.Module | None = None) -> None:
        self.graph_module = graph_module
        self.root = root if root is not None else graph_module
        self.nodes: list[Node] = list(graph_module.graph.nodes)
        self.index: dict[Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [i for i, n in enumerate(self.nodes) if n.op == "placeholder"]
        self.output = next(i for i, n in enumerate(self.nodes) if n.op == "output")
        self.operators = [i for i, n in enumerate(self.nodes) if n.op in OPERATOR_KINDS]
        self.inputs: list[list[int]] = [[self.index[a] for a in n.all_input_nodes] for n in self.nodes]
        self.users: list[list[int]] = [sorted(self.index[u] for u in n.users) for n in self.nodes]
        last_use: dict[int, int] = {}
        for i, ins in enumerate(self.inputs):
            for j in ins:
                last_use[j] = i
        self.frees_after: list[list[int]] = [[] for _ in self.nodes]
        for j, i in last_use.items():
            if i != self.output:
                self.frees_after[i].append(j)
        for i, node in enumerate(self.nodes):
            if not node.users and node.op not in ("placeholder", "output"):
                self.frees_after[i].append(i)  # dead values go at once, as in fx's generated code
        self._steps = [self._compile(n) for n in self.nodes]

    def module_path(self, i: int) -> str:
        """Where node ``i`` comes from in the user's model, for messages."""
        node = self.nodes[i]
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            return f"{path} ({node.name})"
        if node.op == "call_module":
            return str(node.target)
        return node.name

    def run_node(self, i: int, env: list[Any]) -> Any:
        """Execute node ``i`` reading its inputs from ``env``."""
        return self._steps[i](env)

    def run(self, placeholder_values: list[Any],
            after: Callable[[int, Any], None] | None = None,
            before: Callable[[int], None] | None = None) -> Any:
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
                before(i)
            env[i] = steps[i](env)
            if after is not None:
                after(i, env[i])
            for j in frees[i]:
                env[j] = None
        raise AssertionError("graph has no output node")

    # -- compilation -------------------------------------------------------------------------------------------

    def _resolve(self, target: str) -> tuple[Any, str]:
        """(owner object, attribute name) for a dotted target, preferring ``root``."""
        *path, name = target.split(".")
        for base in (self.root, self.graph_module):
            owner = base
            try:
                for part in path:
                    owner = getattr(owner, part)
                getattr(owner, name)
            except AttributeError:
                continue
            return owner, name
        raise AttributeError(f"graph target {target!r} not found on the module")

    def _compile(self, node: Node) -> Callable[[list[Any]], Any]:
        fetch = self._fetcher(node.args)
        fetch_kwargs = self._fetcher(node.kwargs) if node.kwargs else None
        if node.op == "placeholder":
            return lambda env, i=self.index[node]: env[i]
        if node.op == "output":
            return lambda env: fetch(env)[0]
        if node.op == "get_attr":
            owner, name = self._resolve(node.target)
            return lambda env: getattr(owner, name)
        if node.op == "call_module":
            owner, name = self._resolve(node.target)
            module = getattr(owner, name)
            fn: Callable[..., Any] = module
        elif node.op == "call_method":
            fn = _method_caller(node.target)
        else:
            fn = node.target
        if fetch_kwargs is None:
            return lambda env: fn(*fetch(env))
        return lambda env: fn(*fetch(env), **fetch_kwargs(env))

    def _fetcher(self, template: Any) -> Callable[[list[Any]], Any]:
        index = self.index
        if isinstance(template, tuple) and all(not isinstance(a, (tuple, list, dict, slice)) for a in template):
            refs = tuple((isinstance(a, Node), index[a] if isinstance(a, Node) else a) for a in template)
            return lambda env: tuple(env[v] if is_ref else v for is_ref, v in refs)
        return lambda env: map_arg(template, lambda n: env[index[n]])


def _method_caller(name: str) -> Callable[..., Any]:
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)
