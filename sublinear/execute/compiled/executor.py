"""Run a plan compiled: the plan as AOTAutograd's partition, forward and backward compiled by inductor.

The partitioner splits the joint graph (:mod:`sublinear.capture.joint`) into a forward graph, which returns what
backward reads (the saved values), and a backward graph, which recomputes every other forward value it reads.
Inductor compiles both, so recompute fuses into the backward's kernels. The plan enters as the partitioner's
recompute tags (``CheckpointPolicy`` in ``node.meta["recompute"]``), set on every forward node of the joint graph by
a :class:`~torch._inductor.custom_graph_pass.CustomPartitionerFn` that then runs inductor's own min-cut partitioner:

- a node of an op the plan recomputes is ``MUST_RECOMPUTE`` unless every storage of its value is retained (a block
  boundary, or a value a later block reads): backward rebuilds it from the nearest saved values, as the block's
  recompute closure does;
- so is a view, in any op, of a storage another op makes that the plan does not retain (a linear's reshape of its
  input): re-run from the rebuilt base, it costs nothing, and saving it would keep the whole base;
- every other node is ``MUST_SAVE``: the forward saves it when backward, or a recompute, reads it;
- backward nodes are ``MUST_RECOMPUTE``: left to itself, the partitioner computes in forward (and saves) a backward
  node that needs no gradient, where that saves fewer bytes than what it reads; kept in backward, what forward saves
  is exactly what backward reads.

With every node tagged the partition is the plan's, and the simulator's reading of it
(:mod:`sublinear.profiling.compiled`) is what runs. Random numbers recompute as drawn in forward: inductor draws them
from seeds that forward saves (where it falls back to aten's generators, the partitioner saves and restores the
generator state around each recomputed random op). BatchNorm updates its running statistics once: AOTAutograd traces
the update as a write after the forward, which a recompute does not repeat.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import logging
import os
import types
import unittest.mock
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

try:
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
except ImportError:  # torch before 2.12 takes any callable as its scheduler pass
    CustomSchedulerPass = object

from sublinear.capture.dynamo import CapturedGraph
from sublinear.core.analysis import PlanAnalysis, StorageState, analyse
from sublinear.core.plan import Plan
from sublinear.capture.shapes import Binding, describe_binding, guards_hold
from sublinear.capture.joint import JointGraph, is_view, labelled_copy, normalise
from sublinear.profiling.compiled import CompiledProfile
from sublinear.profiling.compiled_reruns import SMALL_RESULTS_MADE_EARLY
from sublinear.profiling.compiled_nodes import InductorKinds, is_constant
from sublinear.execute.compiled.products import product_passes
from sublinear.execute.compiled.stored import realized_in_place
from sublinear.execute.compiled.step_memory import CompiledStepMemory, compiled_step_memory
from sublinear.execute.compiled.toolchain import wait_for_isa_probe
from sublinear.profiling.kernels import kernel_memory

__all__ = ["CompiledGraph", "PlanPartitioner", "compile_plan", "inductor_unavailable", "recompute_tags",
           "resolve_compiler"]

log = logging.getLogger("sublinear.execute.compiled")


def recompute_tags(analysis: PlanAnalysis, node_names: Sequence[str]) -> dict[str, bool | None]:
    """Per forward node of the joint graph (by name): True when backward must recompute it, False when forward must
    save it if anything in backward reads it, None when it is recomputed where a recomputed reader needs it: a value
    only its own recomputed op reads (otherwise there is no reason to recompute the multi-output node it is taken
    from: a variance beside the mean a plan keeps), or one its recomputed op makes again when re-run
    (:func:`~sublinear.core.analysis.made_again_by_its_op`)."""
    profile = analysis.profile
    retained = analysis.state == StorageState.RETAINED
    inside = profile.arrays.read_through_only  # values its op's kernels compute and keep to themselves
    made_again = analysis.made_again
    tags: dict[str, bool | None] = {}
    for i, name in enumerate(node_names):
        op = profile.op_of_node[i]
        every = profile.node_storages.get(i, ())
        storages = [s for s in every if s >= 0 and not inside[s]]
        if analysis.recomputed[op] and (every and not storages or storages and all(made_again[s] for s in storages)):
            tags[name] = None
            continue
        held = bool(storages) and all(retained[s] for s in storages)
        views_other_op = bool(storages) and all(profile.storage_producer[s] != op for s in storages)
        tags[name] = not held and (bool(analysis.recomputed[op]) or views_other_op)
    return tags


class PlanPartitioner(CustomPartitionerFn):
    """Inductor's min-cut partitioner on a joint graph whose forward nodes carry a plan's recompute tags."""

    def __init__(self, tags: dict[str, bool | None], channels_last: bool) -> None:
        self.tags, self.channels_last = tags, channels_last
        self.applied: bool | None = None  # whether the joint graph matched the planned one
        self._uuid = hashlib.sha256(repr((sorted(tags.items()), channels_last)).encode()).hexdigest()

    def uuid(self) -> str:
        return self._uuid

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> tuple[fx.GraphModule,
                                                                                                fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        joint = JointGraph.of(normalise(gm), kwargs["num_fwd_outputs"])
        self.applied = [n.name for n in joint.forward] == list(self.tags)
        if self.applied:
            # A multi-output node is recomputed when any output is (it cannot be saved); a value only its own op
            # reads, when a recomputed reader needs it. A constant is never saved: backward's kernels that read it
            # make its values themselves, as forward's do (the profile has no op read one from the op that made it).
            kinds = InductorKinds()
            recompute: dict[str, bool] = {}
            for node in reversed(joint.forward):
                tag = True if is_constant(node, kinds) else self.tags[node.name]
                multi_output = not isinstance(node.meta.get("val"), torch.Tensor) and node.users
                recompute[node.name] = bool(tag) or ((tag is None or multi_output)
                                                     and any(recompute.get(u.name, False) for u in node.users))
            for node in joint.forward:
                node.meta["recompute"] = (CheckpointPolicy.MUST_RECOMPUTE if recompute[node.name]
                                          else CheckpointPolicy.MUST_SAVE)
            for node in joint.backward:  # backward stays in backward: forward saves what backward reads, as planned
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        forward, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if self.applied:
            drop_unread_saved_values(forward, backward, kwargs["num_fwd_outputs"])
        realized_in_place(backward, self.channels_last)
        return forward, backward


def drop_unread_saved_values(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Forward saves only the tensors backward reads. The min-cut partitioner's backward can re-run a random op
    nothing reads (dead-code elimination keeps random ops), so forward saves that op's input; its pass reordering
    backward as autograd runs it then drops the re-run, leaving the input saved and unread, and inductor keeps every
    saved value from forward to the end of backward."""
    unread = {n.name: n for n in backward.graph.find_nodes(op="placeholder")
              if not n.users and not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor)}
    output = forward.graph.find_nodes(op="output")[0]
    values = list(output.args[0])
    dropped = {i for i in range(num_fwd_outputs, len(values))
               if isinstance(values[i], fx.Node) and values[i].name in unread}
    if not dropped:
        return
    for key in ("desc", "output_stack_traces"):
        if isinstance(output.meta.get(key), list) and len(output.meta[key]) == len(values):
            output.meta[key] = [v for i, v in enumerate(output.meta[key]) if i not in dropped]
    for i in dropped:
        backward.graph.erase_node(unread[values[i].name])
    output.args = (tuple(v for i, v in enumerate(values) if i not in dropped),)
    forward.graph.eliminate_dead_code()
    forward.recompile()
    backward.recompile()


ADMITTED_BINDINGS = 256  # sizes whose guard check is remembered per compiled graph


class CompiledGraph:
    """A captured graph under a plan, compiled by inductor at its first call; call it with the graph's placeholder
    values, as the graph itself. Once compiled, ``peak_bytes`` is the peak of one training step of the graph alone
    as its compiled forward and backward hold memory (None: not known).

    A static graph compiles for its call's shapes. A dynamic graph planned for ``bound`` (its symbols' sizes)
    compiles once for every size: inductor traces it on inputs whose sizes are symbols hinted at the bound, and
    ``peak_bytes`` is the step's peak at the bound. The sizes that code serves are those its shape guards admit; a
    call outside them gets code compiled for its own shapes.
    """

    def __init__(self, graph: CapturedGraph, analysis: PlanAnalysis, node_names: Sequence[str],
                 bound: Binding | None = None, *, channels_last: bool) -> None:
        self.graph = graph
        self.analysis = analysis
        self.node_names = tuple(node_names)  # the joint graph's forward nodes, as the profile numbers them
        self.partitioner = PlanPartitioner(recompute_tags(analysis, node_names), channels_last)
        self.scheduling = ResultsTakenAtOnce()
        self.bound = dict(bound or {})
        self.channels_last = channels_last  # convolutions laid out channels-last, as the plan's profile has them
        self._compiled: Callable[..., Any] | None = None
        self._guards: tuple[Any, ...] = ()  # sympy expressions over the family's symbols
        self._admitted: dict[tuple, Callable[..., Any]] = {}  # binding -> the code serving it
        self.memory: CompiledStepMemory | None = None
        self.peak_bytes: int | None = None
        self._walk: Callable[[tuple[str, ...]], CompiledStepMemory | None] | None = None
        self._memory_by_uses: dict[tuple[str, ...], CompiledStepMemory | None] = {}
        self._unbuilt_by_uses: dict[tuple[str, ...], CompiledStepMemory | None] = {}  # read before compiling

    @property
    def plan(self) -> Plan:
        return self.analysis.plan

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, *values: Any) -> Any:
        self.compile(values)
        if not self.bound:
            return self._compiled(*values)
        binding = self.graph.sizes.binding(values)
        key = tuple(sorted(binding.items()))
        code = self._admitted.get(key)
        if code is None:
            if guards_hold(self._guards, binding):
                code = self._compiled
            else:
                log.info("sublinear: graph compiled for %s does not serve %s (its shape guards: %s); compiling for "
                         "these shapes", describe_binding(self.bound), describe_binding(binding),
                         ", ".join(map(str, self._guards)))
                code = self._compile(values, {})[0]
            if len(self._admitted) >= ADMITTED_BINDINGS:  # a scalar input (a counter) takes a new value each call
                self._admitted.clear()
            self._admitted[key] = code
        return code(*values)

    def compile(self, values: Sequence[Any]) -> None:
        """Compile for ``values`` (real tensors of the call), or for the bound's family, once."""
        if self._compiled is not None:
            return
        self._compiled, graphs, self._guards, sizes = self._compile(values, self.bound)
        if self.partitioner.applied is False:
            log.warning("sublinear: the graph inductor traced to compile differs from the one planned; it runs with "
                        "torch.compile's own partition (exact gradients, the plan's memory not guaranteed)")
        self._walk = functools.partial(_step_memory, graphs, sizes, _device(values), self.scheduling.origins)
        self.memory = self.memory_for(self.analysis.profile.output_uses)
        self.peak_bytes = self.memory.peak if self.memory is not None else None

    def memory_for(self, uses: Sequence[str]) -> CompiledStepMemory | None:
        """The compiled step's memory when the call does ``uses`` with the graph's outputs (variants planned for
        other uses share one partition, and so its code); None before compiling or for code the walk cannot
        read."""
        uses = tuple(uses)
        if self._walk is not None and uses not in self._memory_by_uses:
            self._memory_by_uses[uses] = self._walk(uses)
        return self._memory_by_uses.get(uses, self.memory)

    def memory_without_kernels(self, values: Sequence[Any], uses: Sequence[str]) -> CompiledStepMemory | None:
        """What :meth:`memory_for` reads once compiled, read from the wrapper code inductor generates for this
        plan without building its kernels (a few times cheaper than compiling; once compiled, the compiled code's).
        The kernels are generated unvectorised: vectorising changes the loops inside a kernel, not the buffers the
        wrapper allocates and frees around it."""
        if self._walk is not None:
            return self.memory_for(uses)
        uses = tuple(uses)
        if uses not in self._unbuilt_by_uses:
            with _wrapper_code_only():
                _, graphs, _, sizes = self._compile(values, self.bound)
            self._unbuilt_by_uses[uses] = _step_memory(graphs, sizes, _device(values), self.scheduling.origins, uses)
        return self._unbuilt_by_uses[uses]

    def _compile(self, values: Sequence[Any], bound: Binding) -> tuple[Callable[..., Any], list, tuple, dict]:
        """Code for ``values``' shapes, or for every size when ``bound`` is given; the forward and backward graphs
        inductor compiled with their wrappers' source; the shape guards of the code (over the family's symbols);
        and the value at the bound of each size symbol the wrappers name."""
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        graphs: list[tuple[bool, fx.GraphModule, str | None]] = []

        def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            code = compile_fx_inner(gm, example_inputs, **kwargs)
            graphs.append((bool(kwargs.get("is_backward")), gm, getattr(code, "source_code", None)))
            return code

        inputs, renamed = (self.graph.sizes.symbolic_inputs(values, bound) if bound else (list(values), {}))
        wait_for_isa_probe()
        # Backward is compiled now, under these settings, rather than at its first run after they are gone.
        # AOTAutograd's cache stays off: a hit returns code without running the partitioner or inductor here, so
        # neither whether the plan was applied nor the compiled graphs' memory would be known (inductor's own
        # cache of each graph still serves).
        with functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False), \
                torch._inductor.virtualized.V.set_choices_handler(NearFusionChoices()):
            code = compile_fx(labelled_copy(self.graph.graph_module), inputs, inner_compile=inner,
                              config_patches=compile_patches(self.partitioner, self.scheduling, self.channels_last))
        if not bound:
            return code, graphs, (), {}
        env = torch._guards.detect_fake_mode(inputs).shape_env
        guards = tuple(g.expr.xreplace({s: sympy.Symbol(renamed[s.name], integer=True)
                                        for s in g.expr.free_symbols if s.name in renamed}) for g in env.guards)
        # each symbol's value as the environment hinted it (the bound, or a scalar input's own value)
        hints = {str(symbol): int(value) for symbol, value in env.backed_var_to_val.items()}
        return code, graphs, guards, {env_name: hints[env_name] for env_name in renamed}


def _step_memory(graphs: list[tuple[bool, fx.GraphModule, str | None]], sizes: dict[str, int],
                 device: torch.device, origins, uses: Sequence[str]) -> CompiledStepMemory | None:
    """The memory of one training step from the compiled forward and backward (:mod:`.step_memory`), library calls
    measured on ``device``, with its trace by node. ``sizes``: the value of each size symbol the wrappers name;
    ``uses``: what the call does with each tensor output."""
    forward = [g for g in graphs if not g[0]]
    backward = [g for g in graphs if g[0]]
    if len(forward) != 1 or len(backward) != 1 or forward[0][2] is None or backward[0][2] is None:
        return None
    kernels = kernel_memory(str(device)) if device.type in ("cpu", "cuda") else None
    return compiled_step_memory(forward[0][1:], backward[0][1:], sizes, kernels, origins, uses)


@contextlib.contextmanager
def _wrapper_code_only() -> Iterator[None]:
    """Inductor generates and writes each graph's wrapper code but never loads it, so no kernel is built (the code
    returned cannot run), unvectorised, and with its graph cache off, so that no such code is ever served."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import PyCodeCache

    def unloaded(key: str, path: str, linemap: Any = None, attrs: Any = None) -> Any:
        return types.SimpleNamespace(call=None, runner=None, __file__=path)

    with unittest.mock.patch.object(PyCodeCache, "load_by_key_path", unloaded), \
            inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}):
        yield


def _device(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


class ResultsTakenAtOnce(CustomSchedulerPass):
    """Every element of a library call's result tuple is taken out right after the call. Inductor's scheduler may
    leave taking some out (a convolution backward's weight and bias gradients) until the end of the graph, and the
    tuple holds every element until then, so the input gradient a convolution's backward returns stays in memory
    through the rest of the backward after its last reader. It also records, per graph ("forward", "backward"),
    the nodes of the partitioned graph that each buffer computes (``origins``, views left out: they compute
    nothing), so that what the compiled code holds can be told apart by node."""

    def __init__(self) -> None:
        self.origins: dict[str, dict[str, tuple[str, ...]]] = {}

    def __call__(self, nodes: list) -> list:
        from torch._inductor import ir  # noqa: PLC0415
        from torch._inductor.virtualized import V  # noqa: PLC0415

        taken: dict[str, list] = {}  # a buffer -> the nodes taking elements out of it
        origins = self.origins.setdefault("backward" if V.graph.is_backward else "forward", {})
        for node in nodes:
            for inner in node.get_nodes():
                names = tuple(sorted(o.name for o in (getattr(inner.node, "origins", None) or ()) if _computes(o)))
                for buffer in inner.get_outputs():
                    origins[buffer.get_name()] = names
            if isinstance(getattr(node, "node", None), ir.MultiOutput) and node.node.inputs:
                taken.setdefault(node.node.inputs[0].get_name(), []).append(node)
        order: list = []
        placed: set[int] = set()

        def place(node) -> None:
            if id(node) in placed:
                return
            placed.add(id(node))
            order.append(node)
            for buffer in node.get_outputs():
                for element in taken.get(buffer.get_name(), ()):
                    place(element)

        for node in nodes:
            place(node)
        return order

    def uuid(self) -> str:
        # Inductor's cache keys compiled code on this pass's uuid, not on the fusion choices it compiled under
        # (NearFusionChoices): the uuid names both, so that code fused under other rules is never served.
        return "sublinear-results-taken-at-once-1-near-fusion-15"


def _computes(node: fx.Node) -> bool:
    """Whether a buffer made from ``node`` computes it where the buffer is made. A view computes nothing; nor does a
    concatenation: its buffer is allocated before the kernels that make its parts write them into it, each where
    its part is made, so it names the parts' nodes, never the concatenation's (whose backward rank is the last)."""
    return not is_view(node) and node.target is not torch.ops.aten.cat.default


class NearFusionChoices(InductorChoices):
    """Inductor's fusion heuristics, with more, so that kernels run in the partitioned graph's order, which is what
    the plan's memory model follows. A fused kernel runs where its first node was (inductor sorts fused nodes by
    their first node and then places every producer before its consumers):

    - a producer is fused into a consumer only when the two are near in the graph's order, as inductor already
      requires of two consumers of the same values. Fused far from where it was, a producer runs where the later
      kernel runs: a recomputed layer norm fused into its backward delays the weight gradient that reads it, and
      the output gradient that product reads stays in memory until then;
    - two consumers of the same values (a horizontal fusion) are fused only when every producer of the later one
      has run by the earlier one's place. Otherwise those producers run early: in a backward that recomputes, the
      rotary embedding of a block recomputed later (it reads the same cos and sin) fused into this block's
      backward pulls that block's whole recompute up into this block's backward, and holds it through it;
    - and where a library kernel runs between the two, only when the later one makes no buffer there beyond one of
      its inputs' whose place it takes (an input of the same size that only it reads from the earlier one's place
      on; inductor writes such a result in place) or small results (:attr:`SMALL_RESULTS`). Fused, the kernel
      holds both nodes' inputs and results at once: a GEGLU's backward fused with its recomputed output held the
      projection, the output and the projection's gradient together, where the graph's order holds the output
      only until the weight gradient between them has read it. A BatchNorm's backward written in place of its
      input frees the gradient it shares with the other branch's before the convolution's backward instead."""

    FAR = 64  # nodes apart in the graph's order (inductor's own limit for consumers fused together)
    # Bytes of results a horizontal fusion across a library kernel may make early. A BatchNorm backward's
    # per-channel sums are made before the kernel that reads the gradient they reduce; refused, the kernels that
    # read those sums could not fuse either, and the gradient (a whole activation) was held through a convolution's
    # backward. The profile follows the same rule.
    SMALL_RESULTS = SMALL_RESULTS_MADE_EARLY

    def __init__(self) -> None:
        super().__init__()
        self._library_orders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> sorted orders

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        far = max(abs(node1.min_order - node2.max_order), abs(node2.min_order - node1.max_order))
        return far <= NearFusionChoices.FAR

    def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score) -> bool:
        if not InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            return False
        first, later = sorted((node1, node2), key=lambda node: node.min_order)
        for dep in later.unmet_dependencies:
            buffer = scheduler.name_to_buf.get(dep.name)
            producer = buffer and buffer.defining_op and scheduler.name_to_fused_node.get(buffer.defining_op_name())
            if producer is not None and producer is not first and producer.min_order > first.min_order:
                return False
        orders = self._library_orders.get(scheduler)
        if orders is None:  # library kernels are never fused: their places stay those of the graph's order
            orders = self._library_orders[scheduler] = sorted(n.min_order for n in scheduler.nodes if n.is_extern())
        if bisect.bisect_right(orders, first.min_order) == bisect.bisect_left(orders, later.min_order):
            return True
        return _made_early(scheduler, first, later) <= NearFusionChoices.SMALL_RESULTS


def _bytes(buffer) -> int:
    """A scheduler buffer's bytes, its sizes at their hints (none for a buffer without storage of its own)."""
    from torch._inductor.ir import MultiOutputLayout, NoneLayout  # noqa: PLC0415
    from torch._inductor.virtualized import V  # noqa: PLC0415

    node = buffer.node
    if isinstance(node.layout, (NoneLayout, MultiOutputLayout)):
        return 0
    return V.graph.sizevars.optimization_hint(node.get_numel(), fallback=0) * node.get_dtype().itemsize


def _made_early(scheduler, first, later) -> int:
    """The bytes of ``later``'s results that fused into ``first`` are new buffers at ``first``'s place: every
    result but one that takes the place of an input of the same size ``later`` alone reads from there on (never one
    ``first`` reads, nor a graph's input or output)."""
    from torch._inductor.scheduler import OutputNode  # noqa: PLC0415

    dying = []
    for name in {dep.name for dep in later.read_writes.reads}:
        buffer = scheduler.name_to_buf.get(name)
        if buffer is None:
            continue
        readers = [use.node for use in buffer.users]
        if any(isinstance(user, OutputNode) for user in readers):
            continue
        readers = [scheduler.name_to_fused_node.get(user.get_name(), user) for user in readers]
        if all(user is later or (user is not first and user.min_order < first.min_order) for user in readers):
            dying.append(_bytes(buffer))
    made = 0
    for size in map(_bytes, later.get_outputs()):
        if size in dying:
            dying.remove(size)
        else:
            made += size
    return made


def compile_patches(partitioner: CustomPartitionerFn, scheduling: ResultsTakenAtOnce,
                    channels_last: bool) -> dict[str, Any]:
    """Inductor settings for a planned graph: the plan's partition; every buffer freed after its last use (inductor
    otherwise keeps a dead buffer until a later one of the same size takes its place, which in a backward that
    recomputes holds dead activations for most of the step; the allocator reuses the memory itself); kernels in the
    order of the partitioned graphs, which is what the plan's memory model follows (inductor's own reordering for
    peak memory follows its estimate instead), matrix products among them (:mod:`.products`); and library calls'
    results taken out at once; and the convolutions in the profile's layout: inductor's layout optimization off
    where the profile has them as traced, forced on where it has them channels-last (inductor decides each graph's
    layout on that graph alone, and would run a backward re-running no convolution as traced)."""
    return {"custom_partitioner_fn": partitioner, "allow_buffer_reuse": False, "reorder_for_peak_memory": False,
            "_post_fusion_custom_pass": scheduling, **product_passes(),
            **({"force_layout_optimization": True} if channels_last else {"layout_optimization": False})}


def compile_plan(graph: CapturedGraph, compiled: CompiledProfile, plan: Plan) -> CompiledGraph:
    """``graph`` under ``plan`` (for ``compiled.profile``), to be compiled by inductor at its first call."""
    return CompiledGraph(graph, analyse(compiled.profile, plan), compiled.node_names,
                         channels_last=compiled.channels_last)


@functools.cache
def inductor_unavailable(device_type: str) -> str:
    """Why inductor cannot compile for ``device_type`` here ("" when it can)."""
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - any failure means no compiler
            return f"no C++ compiler for inductor's CPU kernels ({exc})"
        return ""
    if device_type == "cuda":
        try:
            import triton  # noqa: F401, PLC0415
        except ImportError:
            return "triton is not installed"
        return ""
    return f"inductor does not compile for {device_type}"


def resolve_compiler(setting: str, device_type: str) -> tuple[str, str]:
    """The compiler that runs graphs on ``device_type`` for the config's ``compiler`` setting, and why, when it is
    the eager executor ("" for inductor): "auto" is ``$SUBLINEAR_COMPILER`` when set, else inductor where it can
    compile for the device, else eager (said once at WARNING). Meta tensors run nowhere: "auto" plans them for the
    eager executor, whose memory the max-batch comparison's eager baselines share; set ``compiler="inductor"`` to
    plan a meta model as inductor would run it."""
    chosen = 'compiler="eager"'
    if setting == "auto":
        setting = os.environ.get("SUBLINEAR_COMPILER", "") or "auto"
        if setting not in ("auto", "inductor", "eager"):
            raise ValueError(f"SUBLINEAR_COMPILER must be inductor or eager; got {setting!r}")
        chosen = "SUBLINEAR_COMPILER=eager"
    if setting != "auto":
        return setting, chosen if setting == "eager" else ""
    if device_type == "meta":
        return "eager", 'a model on the meta device is planned for the eager executor unless compiler="inductor"'
    reason = inductor_unavailable(device_type)
    if reason:
        _warn_eager(device_type, reason)
        return "eager", reason
    return "inductor", ""


@functools.cache
def _warn_eager(device_type: str, reason: str) -> None:
    log.warning("sublinear: graphs on %s run on sublinear's eager executor: %s", device_type, reason)
