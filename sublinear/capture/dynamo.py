"""Capture: TorchDynamo turns the user's forward into torch.fx graphs; sublinear plans each graph it receives.

Dynamo keeps Python's semantics where a graph cannot: guards re-capture when a Python-level fact a graph depends on
changes (an attribute, a flag, a swapped submodule or forward), side effects (module attributes, counters, lists)
are replayed in Python after the graph runs, a ``torch.autograd.Function`` stays one node with its own backward,
and code it cannot put in a graph (``.item()``, data-dependent branches, prints) runs eagerly between graphs.

A :class:`CapturedGraph` is one graph as a backend receives it: an fx ``GraphModule`` whose placeholders are the
graph's inputs (parameters and buffers are lifted to inputs, so the graph holds no module state), with each
placeholder's kind and where every node comes from in the user's code.

:func:`capture` runs Dynamo once on a data-less twin of a module (fake tensors on the module's own device), so
graphs can be planned before training without running the model or touching it. Graph breaks and the errors a
capture raises: :mod:`sublinear.capture.errors`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from sublinear.capture.checkpoints import inline_checkpoints
from sublinear.capture.errors import (CaptureError, GraphBreak, ModelErrorsAsEager, NeedsData, capture_error,
                                     eager_or_model_error, graph_breaks, model_error)
from sublinear.capture.outputs import GraphOutputs
from sublinear.capture.shapes import SymbolicSizes, symbolic_sizes
from sublinear.tensors import stand_in_for_grad

__all__ = ["DISPATCH", "Capture", "CaptureError", "CapturedGraph", "FakeTwin", "GraphBreak", "GraphOutputs",
           "GraphReceiver", "InputSignature", "ModelErrorsAsEager", "NeedsData", "SharedGraph", "capture",
           "compile_entry", "eager_or_model_error", "graph_breaks", "input_signature", "model_error", "receiving"]

log = logging.getLogger("sublinear.capture.dynamo")

PARAMETER, BUFFER, INPUT, SYMBOL = "parameter", "buffer", "input", "symbol"
_ONCE_ONLY_LOGGING = ("warning_once", "info_once")  # logging.Logger methods transformers adds


@dataclass(frozen=True)
class InputSignature:
    """Shapes, dtypes, devices and requires_grad of a call's tensor leaves, and its other leaves."""

    tensors: tuple[tuple[tuple[int, ...], str, str, bool], ...]
    constants: tuple[str, ...]

    def describe(self, device: str | None = None) -> str:
        """``(8, 512):int64@cpu, ...``; ``device`` names the device every tensor stands for."""
        parts = [f"{tuple(shape)}:{dtype.removeprefix('torch.')}@{device or dev}"
                 for shape, dtype, dev, _ in self.tensors]
        return ", ".join(parts) or "no tensors"


def input_signature(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> InputSignature:
    tensors, constants = [], []
    for leaf in tree_leaves((tuple(args), dict(kwargs or {}))):
        if isinstance(leaf, torch.Tensor):
            tensors.append((tuple(leaf.shape), str(leaf.dtype), str(leaf.device), leaf.requires_grad))
        else:
            constants.append(repr(leaf))
    return InputSignature(tuple(tensors), tuple(constants))


@dataclass
class CapturedGraph:
    """One Dynamo graph: ``graph_module`` with one placeholder per input, in the order the backend receives them.

    ``kinds[i]`` is the kind of placeholder ``i`` (parameter, buffer, input or symbol, i.e. a SymInt size);
    ``sources[i]`` names it in the user's terms (``L['self'].encoder.layer[0]...weight``). ``example_values`` are
    data-less values of the call it was captured at (fake tensors), when captured by :func:`capture`.
    """

    graph_module: fx.GraphModule
    kinds: tuple[str, ...]
    sources: tuple[str, ...]
    example_values: list[Any] | None = None
    example_outputs: GraphOutputs | None = None  # what it returned on the example values, when captured by capture()
    model_device: str | None = None  # set by capture(): the device the example values stand for (meta: fake CPU)
    sizes: SymbolicSizes | None = None  # a dynamic graph's symbolic input sizes (None: every size is static)
    lm_heads: tuple = ()  # the cross-entropies found, chunked or left alone (sublinear.capture.lm_head.LMHead)
    returned_logits: tuple = ()  # chunked heads' logits returned detached (sublinear.capture.returned_logits)
    attention: tuple = ()  # the attentions found, fused or left alone (sublinear.capture.attention.AttentionSite)

    @staticmethod
    def from_dynamo(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CapturedGraph:
        """The graph a Dynamo backend received (without holding on to the example inputs), with the user's
        ``torch.utils.checkpoint`` regions inlined (:func:`~sublinear.capture.checkpoints.inline_checkpoints`).
        A call on fake tensors (a data-less step under a FakeTensorMode, as the max-batch tool runs models that read
        input values) stands for a model on the meta device: it runs nowhere and is planned as one."""
        inline_checkpoints(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        kinds, sources = [], []
        for node, value in itertools.zip_longest(placeholders, example_inputs):
            grapharg = node.meta.get("grapharg") if node is not None else None
            source = grapharg.source.name if grapharg is not None and grapharg.source is not None else \
                (node.name if node is not None else "?")
            sources.append(str(source))
            if not isinstance(value, torch.Tensor):
                kinds.append(SYMBOL)
            elif isinstance(value, nn.Parameter) or "._parameters[" in str(source):
                kinds.append(PARAMETER)
            elif "._buffers[" in str(source):
                kinds.append(BUFFER)
            else:
                kinds.append(INPUT)
        data_less = any(isinstance(v, FakeTensor) for v in example_inputs)
        return CapturedGraph(gm, tuple(kinds), tuple(sources), model_device="meta" if data_less else None,
                             sizes=symbolic_sizes(gm))

    def copied_module(self) -> fx.GraphModule:
        """A copy of ``graph_module`` to rewrite, leaving this graph's as it is."""
        copied = fx.Graph()
        copied.output(copied.graph_copy(self.graph_module.graph, {}))
        return fx.GraphModule(self.graph_module, copied)

    @functools.cached_property
    def code(self) -> str:
        """The graph's Python code without the placeholders' type annotations (which name the example values'
        classes), as on the model's device and with its size symbols renamed in order of use: equal for every
        capture of the same forward, real or fake."""
        head, _, body = self.graph_module.code.partition("\n    ")
        code = re.sub(r" : [\w.]+", "", head) + "\n    " + body
        if self.model_device == "meta":  # captured on fake CPU tensors standing for meta ones
            code = code.replace("device(type='cpu')", "device(type='meta')")
        return self.sizes.rename(code) if self.sizes is not None else code

    @property
    def num_operators(self) -> int:
        return sum(1 for n in self.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))

    def describe(self) -> str:
        counts = {k: self.kinds.count(k) for k in (PARAMETER, BUFFER, INPUT, SYMBOL) if k in self.kinds}
        return f"{self.num_operators} operators, inputs " + ", ".join(f"{v} {k}s" for k, v in counts.items())


def module_path(node: fx.Node) -> str:
    """The user's module path of ``node`` (``encoder.layer.0.attention``), or ``""`` at the top level."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?(__self__\.?)?|^L\['[^']*'\]\.?", "", str(path))  # a bound forward: __self__
    # submodules as ._modules['name'], or through __dict__['_modules'] (a wrapper's __getattr__, as peft's)
    path = re.sub(r"(?:\.|^)(?:__dict__\[')?_modules(?:'\])?\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


def source_line(node: fx.Node) -> str:
    """``file:line`` of the user code that made ``node`` (the innermost frame of its stack trace), or ``""``."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path}:{line}"


def describe_node(node: fx.Node) -> str:
    """For messages: ``module.path (node name) at file:line``."""
    where = source_line(node)
    path = module_path(node)
    text = f"{path} ({node.name})" if path else node.name
    return f"{text} at {where}" if where else text


# ---------------------------------------------------------------------------------------------------------------
# Data-less twins and the dry-run capture


_DYNAMIC_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices")  # set by torch._dynamo.mark_dynamic


class FakeTwin:
    """Fake tensors on the real tensors' own devices, from one FakeTensorMode: shapes, dtypes, strides and
    ``requires_grad`` of the originals, no data. Parameters stay parameters."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.mode.cache_enabled = False  # its dispatch cache keeps tensors alive past their last use
        self._memo: dict[int, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        key = id(t)
        if key in self._memo:
            return self._memo[key]
        if self._is_scalar_value(t, device):
            # A Python number TorchDynamo passes as a tensor and reads with .item() in the graph: keep its value
            # (a copy: in-place ops on a constant fake reach the tensor it holds).
            fake = self.mode.fake_tensor_converter.from_real_tensor(self.mode, t.clone(), make_constant=True)
            self._memo[key] = fake
            return fake
        with self.mode:
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
            fake = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else \
                stand_in_for_grad(empty, t)
        for mark in _DYNAMIC_MARKS:  # dimensions the caller marked dynamic stay so
            if hasattr(t, mark):
                setattr(fake, mark, set(getattr(t, mark)))
        self._memo[key] = fake
        return fake

    @staticmethod
    def _is_scalar_value(t: torch.Tensor, device: torch.device | str | None) -> bool:
        return (t.numel() == 1 and t.dim() == 0 and t.device.type == "cpu" and not t.requires_grad
                and device is None and not isinstance(t, (FakeTensor, nn.Parameter)))

    def value(self, value: Any, device: torch.device | str | None = None) -> Any:
        return tree_map(lambda v: self.tensor(v, device) if isinstance(v, torch.Tensor) else v, value)

    def module(self, module: nn.Module, device: torch.device | None = None) -> nn.Module:
        """A deep copy of ``module`` whose parameters, buffers and tensor attributes are fakes (no data copied),
        on ``device`` when given."""
        memo: dict[int, Any] = {}
        for sub in module.modules():
            for value in itertools.chain(sub._parameters.values(), sub._buffers.values(),
                                         (v for v in vars(sub).values() if isinstance(v, torch.Tensor))):
                if value is not None and id(value) not in memo:
                    memo[id(value)] = self.tensor(value, device)
        return copy.deepcopy(module, memo)


def _first_tensor(module: nn.Module) -> torch.Tensor | None:
    return next(itertools.chain(module.parameters(), module.buffers()), None)


def _module_device(module: nn.Module) -> torch.device:
    first = _first_tensor(module)
    return first.device if first is not None else torch.device("cpu")


@dataclass
class Capture:
    """The graphs of one call, in the order they ran, and the graph breaks between them."""

    graphs: list[CapturedGraph]
    breaks: list[GraphBreak] = field(default_factory=list)
    returned: Any = None  # what the module returned (fakes)

    @property
    def graph(self) -> CapturedGraph:
        """The only graph; an error naming the breaks when there are several."""
        if len(self.graphs) != 1:
            where = "; ".join(str(b) for b in self.breaks[:5]) or "no graph was captured"
            raise CaptureError(f"this needs one graph, and TorchDynamo captured {len(self.graphs)} ({where})")
        return self.graphs[0]


class GraphReceiver(Protocol):
    """What runs a captured graph at call time: a dry run's recorder, or a compiled model's session."""

    def run_graph(self, shared: SharedGraph, values: Sequence[Any]) -> Any: ...


_RECEIVER: contextvars.ContextVar[GraphReceiver | None] = contextvars.ContextVar("sublinear_receiver", default=None)


@contextlib.contextmanager
def receiving(receiver: GraphReceiver) -> Iterator[None]:
    """Run the captured graphs of the calls inside the block through ``receiver``."""
    token = _RECEIVER.set(receiver)
    try:
        yield
    finally:
        _RECEIVER.reset(token)


class SharedGraph:
    """A captured graph as TorchDynamo's cache holds it: run by whichever receiver is active at call time (plain,
    when none is)."""

    def __init__(self, graph: CapturedGraph) -> None:
        self.graph = graph

    def __call__(self, *values: Any) -> Any:
        receiver = _RECEIVER.get()
        if receiver is None:
            return self.graph.graph_module(*values)
        return receiver.run_graph(self, values)


class _Dispatch:
    """The one backend object sublinear hands TorchDynamo.

    TorchDynamo's cache entries outlive the ``torch.compile`` call that made them and are shared by every later
    call whose guards match, whichever model or capture they belong to. So the compiled artifact decides nothing
    itself: each run goes to the receiver active at call time (:func:`receiving`). One shared backend also lets
    every model of a class reuse compiled graphs instead of filling the code object's recompile limit.
    """

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return SharedGraph(CapturedGraph.from_dynamo(gm, example_inputs))


DISPATCH = _Dispatch()


_ENTRIES = itertools.count()
_IDENTIFIER = re.compile(r"\W")


def compile_entry(target: Callable[..., Any], name: str, dynamic: bool | None) -> Callable[..., Any]:
    """``target`` (a module or a function) under TorchDynamo with the shared backend, entered through a function
    whose code object belongs to this call alone.

    TorchDynamo keeps its cache and its "skip this frame" marks on code objects. ``torch.compile`` enters a
    ``torch.nn`` module (``nn.Sequential``, ``nn.Linear``) through one wrapper whose code object every such compile
    in the process shares, and a forward with no tensor ops (``nn.Identity``) marks that code skipped: every
    ``torch.nn`` model compiled afterwards would then run eagerly, unplanned. A code object of its own confines
    each mark and each cache to one model.

    TorchDynamo keeps the graphs compiled for a code object in a cache that the code object owns, and maps each
    compiled code back to its source code strongly, which keeps a dropped entry's code object (and every graph in
    its cache) alive for good. The cache is cleared when the entry goes, so a process that compiles many models,
    or one model at many batch sizes, does not keep every graph it ever captured.
    """
    if inspect.ismethod(target) and isinstance(target.__self__, nn.Module):
        # A module's own forward (``sublinear.apply`` replaced the instance's): the module is bound here, so the
        # sources read L['self'].<module path> as for the module itself, not L['self'].__self__...; the graph's
        # code, and the plans keyed on it, are then the same as a capture of the module's data-less twin.
        self, forward = target.__self__, target.__func__

        def entry(*args: Any, **kwargs: Any) -> Any:
            return forward(self, *args, **kwargs)
    else:
        self = target  # the graphs' sources then read L['self'].<module path>, as for a module compiled directly

        def entry(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

    # A name of its own: TorchDynamo keeps what it learned of a frame's sizes (which became dynamic) per file, line
    # and name, so entries of one name would share it across models.
    entry.__code__ = entry.__code__.replace(co_name=f"sublinear_entry_{_IDENTIFIER.sub('_', name)}_{next(_ENTRIES)}")
    weakref.finalize(entry, torch._dynamo.eval_frame.remove_from_cache, entry.__code__).atexit = False
    compiled = torch.compile(entry, backend=DISPATCH, dynamic=dynamic)

    def run(*args: Any, **kwargs: Any) -> Any:
        # An int attribute that a forward changes (a call counter) is an input to the graph, not a constant
        # TorchDynamo guards on: otherwise each new value captures the forward again, until TorchDynamo's recompile
        # limit runs it eagerly. An int that never changes stays a constant.
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True,
                                        ignore_logging_functions=_ignored_logging()):
            return compiled(*args, **kwargs)

    return run


def _ignored_logging() -> set[Callable[..., Any]]:
    """The logging calls TorchDynamo leaves out of the graphs it captures, instead of breaking the graph at them:
    the user's own set, and the once-only logger methods transformers adds (``logger.warning_once``,
    ``info_once``). TorchDynamo cannot put a logging call in a graph; transformers makes such calls inside forwards
    (GPT-2's loss property warns once that its class names no loss type), and a break there puts the LM head and its
    loss in two graphs, which no plan can chunk or see whole. Left out, a once-only message is not printed; since it
    repeats nothing the step computes, the step is the same."""
    ignored = set(torch._dynamo.config.ignore_logging_functions)
    ignored.update(method for method in (getattr(logging.Logger, name, None) for name in _ONCE_ONLY_LOGGING)
                   if method is not None)
    return ignored


def _pack_detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _unpack_as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class _Recorder:
    """A dry run's receiver: collects each graph with the values it ran on and what it returned."""

    def __init__(self) -> None:
        self.graphs: list[CapturedGraph] = []

    def run_graph(self, shared: SharedGraph, values: Sequence[Any]) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(_pack_detached, _unpack_as_is):  # as the rewriter saves
            outputs = shared.graph.graph_module(*values)
        self.graphs.append(dataclasses.replace(shared.graph, example_values=list(values),
                                               example_outputs=GraphOutputs.of(outputs)))
        return outputs


def capture(module: nn.Module, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Capture:
    """The graphs TorchDynamo captures for ``module(*args, **kwargs)`` in training mode, captured on a data-less
    twin of the module: the module, its tensors and its Python state are left as they were. Sizes are static but
    for the dimensions marked dynamic on the arguments (``torch._dynamo.maybe_mark_dynamic``).

    ``args``/``kwargs`` may hold real or meta tensors; meta tensors stand for tensors on the module's device.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"capture() needs an nn.Module, got {type(module).__name__}")
    twin = FakeTwin()
    device = _module_device(module)
    # A model on the meta device is captured as fake CPU tensors (which hold no data either): TorchDynamo keeps
    # tensors that forward builds from constants (torch.tensor([]), as Hugging Face's KV cache does) as real
    # tensors, and real meta tensors then meet fakes in one op and fail.
    stand_in = torch.device("cpu") if device.type == "meta" else device
    try:
        copy_ = twin.module(module, stand_in if stand_in != device else None)
    except Exception as exc:  # noqa: BLE001 - reported with the reason
        raise CaptureError(f"sublinear captures a data-less copy of the model before training, and copying "
                           f"{type(module).__name__} failed: {type(exc).__name__}: {exc}. Call the compiled "
                           "module without example inputs: it then plans at its first training call.") from exc
    copy_.train()
    if getattr(copy_.__dict__.get("forward"), "sublinear_backend", None) is not None:
        del copy_.__dict__["forward"]  # a module sublinear.apply planned: its twin runs the class's forward

    def on_device(t: torch.Tensor) -> torch.Tensor:
        return twin.tensor(t, stand_in if t.device.type == "meta" else None)

    fake_args, fake_kwargs = tree_map(lambda v: on_device(v) if isinstance(v, torch.Tensor) else v,
                                      (tuple(args), dict(kwargs or {})))
    recorder = _Recorder()
    compiled = compile_entry(copy_, type(module).__name__, dynamic=None)
    # A random op with no tensor argument (torch.rand in ViT-MAE's masking) makes a real tensor when the captured
    # graph runs on the twin's fakes, drawing from the global generator: the user's RNG stream is kept as it was.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            with graph_breaks() as breaks, receiving(recorder), \
                    torch._dynamo.config.patch(recompile_limit=10**6, accumulated_recompile_limit=10**6):
                returned = compiled(*fake_args, **fake_kwargs)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - Dynamo's and the model's errors, with the user's line
            error = capture_error(exc, f"{type(module).__name__}.forward")
            if not isinstance(error, NeedsData):  # the twin is a copy: running it again touches nothing of the user's
                eager_or_model_error(copy_, fake_args, fake_kwargs)
            raise error from exc
    # a module whose tensors are fakes (the max-batch tool's twin of a model that reads input values) holds no data:
    # it stands for a meta model, as the fake calls of its training steps do (CapturedGraph.from_dynamo)
    stands_for = "meta" if isinstance(_first_tensor(module), FakeTensor) else str(device)
    graphs = [dataclasses.replace(g, model_device=stands_for) for g in recorder.graphs]
    log.debug("captured %s: %d graph(s), %d graph break(s)", type(module).__name__, len(graphs), len(breaks))
    return Capture(graphs, list(breaks), returned)
