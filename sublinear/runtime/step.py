"""One training call's graph runs, and what they tell each graph: what the other runs keep live beside it
(:func:`step_contexts`) and what the call did with each output (:func:`output_uses`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, GraphOutputs
from sublinear.core.profile import StepContext
from sublinear.training import DROPPED, GRADIENT, HELD, PASSED, held_to_end
from sublinear.runtime.variant import GraphVariant

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime


def _storages(values: list[Any]) -> dict[int, int]:
    """Storage key -> bytes of every tensor among ``values`` (real or fake), each storage once."""
    found: dict[int, int] = {}
    for t in values if all(isinstance(v, torch.Tensor) for v in values) else tree_leaves(values):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            found[storage._cdata] = storage.nbytes()
    return found


@dataclass
class GraphRun:
    """One graph's run in a training call: its variant and the storages it read and produced."""

    runtime: GraphRuntime
    variant: GraphVariant | None  # None: the run of a graph about to be planned
    state: dict[int, int]  # parameter and buffer storages -> bytes
    parameters: dict[int, int]  # parameter storages (backward gives each a gradient of its size)
    inputs: dict[int, int]  # the other tensor inputs
    outputs: dict[int, int] = field(default_factory=dict)  # storages it returned that it made (activations)
    returned: GraphOutputs | None = None  # every tensor output, watched until the call ends
    captures_before: int = 0  # graphs the session had captured when the run began
    followed_by_capture: bool = False  # a graph was captured after it in its call
    held_through_call: tuple[bool, ...] | None = None  # per output, alive when the call returned (None: unknown)
    input_keys: tuple[tuple[int, ...], ...] = ()  # per graph input, the storages of its tensors (inputs only)

    @property
    def held(self) -> int:
        """What the run holds after its forward (0 for a graph about to be planned)."""
        return self.variant.simulation.held_after_forward_bytes if self.variant is not None else 0

    def unsaved_inputs(self) -> set[int]:
        """The input storages the graph's autograd does not save (none where its profile does not say)."""
        saved = self.variant.profile.saved_inputs if self.variant is not None else ()
        if len(saved) != len(self.input_keys):
            return set()
        kept = {k for keys, s in zip(self.input_keys, saved) if s for k in keys}
        return {k for keys, s in zip(self.input_keys, saved) if not s for k in keys} - kept

    def let_go(self, eager: bool) -> dict[int, tuple[int, bool, bool]]:
        """The outputs the call lets go before backward reaches the run's graph (dropped or :data:`PASSED`): bytes,
        whether the caller still held it when the call returned (known only of a call that captured no graph after
        the run: TorchDynamo's trackers of a frame it compiles keep what the frame saw alive until a garbage
        collection), and whether the graph itself holds it after its forward (autograd saved it)."""
        uses = self.variant.uses if self.variant is not None else self.runtime.session.calls.uses.get(
            self.runtime.graph.code)  # a graph about to be planned: the uses it will be planned for
        if uses is None or self.returned is None:
            return {}
        alive = self.held_through_call or (False,) * len(uses)
        retained = (self.variant.outputs_held_after_forward(eager) if self.variant is not None
                    else (False,) * len(uses))  # unknown: counted by the runs reading them
        let_go = {s: (a, r) for s, use, a, r in zip(self.returned.storages, uses, alive, retained)
                  if not held_to_end(use)}
        return {s: (b, *let_go[s]) for s, b in self.outputs.items() if s in let_go}

    @property
    def held_eager(self) -> int:
        """What the run would hold after its forward unplanned."""
        return self.variant.eager_held if self.variant is not None else 0

    @staticmethod
    def of(runtime: GraphRuntime, variant: GraphVariant | None, values: Sequence[Any]) -> GraphRun:
        kinds = runtime.graph.kinds
        parameters = _storages([v for k, v in zip(kinds, values) if k == PARAMETER])
        state = {**parameters, **_storages([v for k, v in zip(kinds, values) if k == BUFFER])}
        inputs = _storages([v for k, v in zip(kinds, values) if k == INPUT])
        input_keys = tuple(tuple(_storages([v])) if k == INPUT else () for k, v in zip(kinds, values))
        return GraphRun(runtime, variant, state, parameters, inputs, input_keys=input_keys)

    def record(self, outputs: GraphOutputs) -> None:
        """What the run returned."""
        self.returned = outputs
        self.outputs = {s: b for s, b in zip(outputs.storages, outputs.nbytes)
                        if s not in self.state and s not in self.inputs}


def _sum_except(storages: dict[int, int], excluded: dict[int, int]) -> int:
    return sum(b for s, b in storages.items() if s not in excluded)


def step_contexts(runs: Sequence[GraphRun], first: int = 0, eager: bool = False) -> list[StepContext]:
    """Per run of one call, what the other runs keep live beside it, with every run at its current plan (``eager``:
    with every run unplanned, the step eager runs); complete for the runs from ``first`` on (the later runs need
    plans, the earlier ones do not).

    Runs go forward in order and backward in reverse order. Beside run i: every parameter and buffer of the call
    and every input the caller passed (held by the caller through the call) that i does not read, what each
    earlier run holds after its forward (less the outputs i reads, which its own profile counts as inputs) and
    the outputs the call let go before backward that their run does not hold after its forward, which i does not
    read but a later run reads or the caller held when the call returned; beside
    its backward also the gradients of later runs' parameters. The later runs' highest peak includes what run i
    holds, so it is given relative to that: a context does not depend on the run's own plan.
    """
    everything: dict[int, int] = {}
    produced: dict[int, int] = {}
    for r in runs:
        everything |= r.state
        produced |= r.outputs
    for r in runs:
        everything |= {s: b for s, b in r.inputs.items() if s not in produced}
    contexts = []
    held_before, earlier_outputs, let_go = 0, {}, {}
    for i, r in enumerate(runs):
        later_parameters: dict[int, int] = {}
        read_later: set[int] = set()
        for later in runs[i + 1:]:
            later_parameters |= later.parameters
            read_later |= set(later.inputs)
        alive_let_go = sum(b for s, (b, by_caller, retained) in let_go.items()
                           if s not in r.inputs and not retained and (by_caller or s in read_later))
        beside_forward = (_sum_except(everything, r.state | r.inputs) + held_before + alive_let_go
                          - sum(b for s, b in r.inputs.items() if s in earlier_outputs))
        # an earlier run's output i reads that the call let go and no one else holds: gone when backward starts
        unsaved = r.unsaved_inputs()
        gone = sum(b for s, b in r.inputs.items() if s in let_go and not let_go[s][2] and s in unsaved)
        contexts.append(StepContext(beside_forward, beside_forward + _sum_except(later_parameters, r.state) - gone))
        held_before += r.held_eager if eager else r.held
        outputs_let_go = r.let_go(eager)
        let_go |= outputs_let_go
        earlier_outputs |= {s: b for s, b in r.outputs.items() if s not in outputs_let_go or outputs_let_go[s][2]}
    later_peak = None
    for i in range(len(runs) - 1, first - 1, -1):
        held = runs[i].held_eager if eager else runs[i].held
        contexts[i] = dataclasses.replace(contexts[i], later_beyond_held=None if later_peak is None
                                          else later_peak - held)
        if i > first:
            peak = runs[i].variant.peak_beside(contexts[i], eager)
            later_peak = peak if later_peak is None else max(later_peak, peak)
    return contexts


def contexts_by_graph(runs: Sequence[GraphRun], eager: bool) -> dict[str, StepContext]:
    """Per graph of a call of several runs, its :func:`step_contexts`; a graph run several times gets the widest."""
    found: dict[str, StepContext] = {}
    if len(runs) > 1:
        for run, context in zip(runs, step_contexts(runs, eager=eager)):
            code = run.runtime.graph.code
            found[code] = widest_context(found[code], context) if code in found else context
    return found


def output_uses(runs: Sequence[GraphRun], returned: Any) -> list[tuple[str, ...]]:
    """Per run of one call that returned ``returned``, per tensor output: what the step did with it (see
    :func:`sublinear.profiling.graph.profile`). A later run reads it, or it is the loss: the scalars among what the call
    returned when there are any (a loss computed in forward), else every floating tensor it returned; those get a
    gradient. Of the others, what is still alive after the call was held (a KV cache, a module attribute) and the
    rest was dropped when the graph returned."""
    returned = [t for t in tree_leaves(returned)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    losses = {t.untyped_storage()._cdata for t in ([t for t in returned if t.dim() == 0] or returned)}
    uses = []
    for i, run in enumerate(runs):
        read_later = set().union(*(later.inputs for later in runs[i + 1:]))
        uses.append(tuple(GRADIENT if s in read_later or s in losses else HELD if alive else DROPPED
                          for s, alive in zip(run.returned.storages, run.returned.alive())))
    return uses


def uses_after_backward(uses: tuple[str, ...], outputs: GraphOutputs) -> tuple[str, ...]:
    """``uses`` as learned when the call returned, with each output held then but let go before backward reached
    its graph (a loss computed from it, then the output dropped) made dropped, or passed where it gets a gradient
    (logits a later graph's loss read): backward runs without it."""
    alive = outputs.alive_at_backward
    if alive is None:
        return uses
    let_go = {HELD: DROPPED, GRADIENT: PASSED}
    return tuple(let_go.get(use, use) if not held else use for use, held in zip(uses, alive))


def planned_knowing_later(variant: GraphVariant, context: StepContext | None) -> bool:
    """Whether ``variant`` was planned knowing the graphs after it, where ``context`` says there are some."""
    return context is None or context.later_beyond_held is None or (
        variant.planned_in is not None and variant.planned_in.later_beyond_held is not None)


def widest_context(a: StepContext, b: StepContext) -> StepContext:
    """A context covering both (a graph that runs several times in a call is planned for its worst run)."""
    later = [v for v in (a.later_beyond_held, b.later_beyond_held) if v is not None]
    return StepContext(max(a.beside_forward, b.beside_forward), max(a.beside_backward, b.beside_backward),
                       max(later) if later else None)
