"""What TorchDynamo calls in place of one captured graph: plain eager without grad, else the variant planned for the
call's signature (:class:`GraphRuntime`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import CapturedGraph, GraphOutputs
from sublinear.capture.returned_logits import attach_returned_logits
from sublinear.capture.shapes import Binding, SymbolicSizes, argument_dims, bucket, covers, describe_binding, join
from sublinear.core.units import format_bytes
from sublinear.execute.compiled import resolve_compiler
from sublinear.planners import BudgetError
from sublinear.runtime.pipeline import Prior
from sublinear.runtime.eager_code import next_node
from sublinear.runtime.step import GraphRun
from sublinear.runtime.variant import GraphVariant
from sublinear.tensors import autocast_state, device_of

if TYPE_CHECKING:
    from sublinear.runtime.session import SublinearBackend

__all__ = ["GraphRuntime", "value_key"]

log = logging.getLogger("sublinear")

_META = torch.device("meta")


def value_key(values: Sequence[Any], model_device: str | None = None, sizes: SymbolicSizes | None = None) -> tuple:
    """What a plan depends on in a graph's inputs: every tensor's shape, stride, dtype, device and requires_grad
    (parameters included), and every other input's value. Values captured for a model on the meta device are fake
    CPU tensors that stand for meta ones (``model_device="meta"``): their key is the meta tensors', so the real
    calls find the plans made ahead. A dynamic graph's symbolic sizes are left out (one key per shape family): the
    bound its plan was made for says which sizes that plan serves."""
    key = []
    for i, v in enumerate(values):
        if sizes is not None and isinstance(sizes.inputs[i], str):
            key.append("symbol")
        elif isinstance(v, torch.Tensor):
            device = v.device
            if model_device == "meta" and device.type == "cpu":
                device = _META
            shape, stride = sizes.masked(i, v) if sizes is not None else (v.shape, v.stride())
            key.append((shape, stride, v.dtype, device, v.requires_grad))
        else:
            key.append(repr(v))
    return tuple(key)


def _any_requires_grad(values: Sequence[Any]) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple, dict)) and _any_requires_grad(tree_leaves(v)):
            return True
    return False


class GraphRuntime:
    """One captured graph of a session: its variants by call signature, and the largest sizes a dynamic graph has
    been called with."""

    def __init__(self, graph: CapturedGraph, session: SublinearBackend, index: int) -> None:
        self.graph = graph
        self.session = session
        self.index = index
        self.variants: dict[tuple, GraphVariant] = {}
        self.seen: Binding = {}

    def key(self, values: Sequence[Any]) -> tuple:
        return (value_key(values, self.graph.model_device, self.graph.sizes), autocast_state(),
                self.session.sharding())

    def compiler(self, values: Sequence[Any]) -> tuple[str, str]:
        """What runs the graph for ``values``, inductor or sublinear's eager executor (see
        :func:`sublinear.execute.compiled.resolve_compiler`), and why, when it is the eager executor ("" for
        inductor); a graph inductor cannot trace runs eagerly."""
        cannot_trace = self.session.pipeline.eager_only.get(self.graph.code)
        if cannot_trace is not None:
            return "eager", f"inductor could not trace its forward and backward ({cannot_trace})"
        # a model on the meta device is captured with fake CPU values; it is planned for the meta device
        device_type = torch.device(self.graph.model_device).type if self.graph.model_device else device_of(values).type
        compiler, why = resolve_compiler(self.session.config.compiler, device_type)
        if compiler == "inductor" and self.session.sharding() is not None:
            _say_fsdp_runs_eagerly()
            return "eager", "FSDP2 shards its parameters; FSDP's hooks are tested with the eager executor's recompute"
        return compiler, why

    def variant_for(self, values: Sequence[Any], dry_run: bool = False) -> GraphVariant:
        """The variant that runs a call with ``values``: planned before for the call's signature (and, for a dynamic
        graph, for sizes at or above the call's), or planned now; compiled, and within the budget as compiled."""
        key = self.key(values)
        variant = self.variants.get(key)
        sizes = self.graph.sizes
        binding = sizes.sizing(sizes.binding(values)) if sizes is not None else {}
        self.seen = join(self.seen, binding)
        if variant is not None and not covers(variant.bound, binding):
            log.info("sublinear: graph %d runs at sizes beyond those its plan was made for (%s); planning again for "
                     "%s", self.index, describe_binding(variant.bound), describe_binding(self.bound_for(self.seen)))
            self.forget(variant)
            variant = None
        pipeline = self.session.pipeline
        if variant is not None and variant.auto_budget and not dry_run and device_of(values).type == "cuda":
            budget = pipeline.budget_for(self, values, dry_run=False)
            if budget is not None and variant.peak_bytes > budget:
                log.info("sublinear: graph %d's plan (%s) no longer fits the device's free memory (%s); planning "
                         "again", self.index, format_bytes(variant.peak_bytes), format_bytes(budget))
                variant = None
        try:
            if variant is None:
                variant = self.variants[key] = self._plan_family(values, key, dry_run, self.seen)
            if not dry_run:
                variant = self.variants[key] = pipeline.compiled_within_budget(self, variant, values, key)
        except BudgetError as exc:  # planned, or compiled, before any call showed the graphs after this one
            if not self.session.calls.previous:
                exc.note_later_graphs_unknown()
            raise
        return variant

    def _plan_family(self, values: Sequence[Any], key: tuple, dry_run: bool, seen: Binding) -> GraphVariant:
        """Plan for ``values``; a dynamic graph for its sizes' bucket (:func:`sublinear.capture.shapes.bucket`), or,
        when no plan fits the budget there, for the largest sizes seen."""
        pipeline = self.session.pipeline
        if not seen:
            return pipeline.plan(self, values, key, dry_run, {})
        bound = self.bound_for(seen)
        try:
            return pipeline.plan(self, values, key, dry_run, bound)
        except BudgetError:
            if bound == seen:
                raise
            log.info("sublinear: graph %d: no plan fits the budget at %s; planning for the sizes seen (%s)",
                     self.index, describe_binding(bound), describe_binding(seen))
            return pipeline.plan(self, values, key, dry_run, seen)

    def bound_for(self, seen: Binding) -> Binding:
        """The sizes to plan a dynamic graph for, having seen ``seen``: the config's ``max_sizes`` for a symbol that
        sizes an argument it names, else the power-of-two bucket of the value seen."""
        bound = bucket(seen)
        limits = dict(self.session.config.max_sizes or ())
        for symbol in bound:
            for name, dim in argument_dims(self.graph.sizes.sources.get(symbol, ()), self.session.positional_names):
                limit = limits.get(name, ())
                if dim < len(limit) and limit[dim] is not None:
                    bound[symbol] = max(limit[dim], seen[symbol])
                    break
        return bound

    def forget(self, variant: GraphVariant) -> None:
        """Plan this signature again at its next run (where its plan still meets the objective, it is kept)."""
        keys = [k for k, v in self.variants.items() if v is variant]
        self.variants = {k: v for k, v in self.variants.items() if v is not variant}
        prior = Prior(variant.plan, variant.rewritten, keys[0] if keys else None, variant.bound,
                      variant.lesson.chunks if variant.lesson else None, variant.settling)
        self.session.pipeline.choices.remember_prior(self.graph.code, prior)

    def __call__(self, *values: Any) -> Any:
        if not torch.is_grad_enabled() or not _any_requires_grad(values):
            return attach_returned_logits(self.graph.returned_logits, self.graph.graph_module(*values), values)[0]
        session = self.session
        if session.calls.starts_again(self.graph.code):
            session.finish_call()  # used as a bare backend, no call boundary is seen: the first graph starts a call
        variant = self.variant_for(values)
        if not session.calls.explicit:  # no call end is seen: planning ends with the graph's
            session.progress.end(lambda: str(variant.summary))
        run = GraphRun.of(self, variant, values)
        first_node = next_node()
        out, held = attach_returned_logits(self.graph.returned_logits, variant.rewritten(*values), values)
        run.nodes = (first_node, next_node())
        run.record(GraphOutputs.of(held, watch_backward=True))
        session.calls.record(run)
        return out


@functools.cache
def _say_fsdp_runs_eagerly() -> None:
    log.warning("sublinear: under FSDP2 the planned graphs run on sublinear's eager executor, whose recompute FSDP's "
                "gather and reduce-scatter hooks are tested with; the compiled executor is not applied there")
