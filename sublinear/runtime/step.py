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
from sublinear.runtime.eager_code import EagerCode
from sublinear.training import DROPPED, GRADIENT, HELD, PASSED, held_to_end
from sublinear.runtime.variant import GraphVariant

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime


def argument_storages(values: Any) -> set[int]:
    """The storages of the tensors among ``values`` (a call's arguments)."""
    return set(_storages([values]))


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
    parameters: dict[int, int]  # storages of the parameters that get gradients (each of its size)
    inputs: dict[int, int]  # the other tensor inputs
    outputs: dict[int, int] = field(default_factory=dict)  # storages it returned that it made (activations)
    returned: GraphOutputs | None = None  # every tensor output, watched until the call ends
    captures_before: int = 0  # graphs the session had captured when the run began
    followed_by_capture: bool = False  # a graph was captured after it in its call
    held_through_call: tuple[bool, ...] | None = None  # per output, alive when the call returned (None: unknown)
    input_keys: tuple[tuple[int, ...], ...] = ()  # per graph input, the storages of its tensors (inputs only)
    nodes: tuple[int, int] | None = None  # the autograd node numbers it made: first, and one past its last

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
        parameters = _storages([v for k, v in zip(kinds, values)
                                if k == PARAMETER and getattr(v, "requires_grad", False)])  # frozen: no gradient
        state = _storages([v for k, v in zip(kinds, values) if k in (PARAMETER, BUFFER)])
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


def step_contexts(runs: Sequence[GraphRun], first: int = 0, eager: bool = False,
                  eager_code: Sequence[EagerCode] = (), arguments: set[int] | None = None) -> list[StepContext]:
    """Per run of one call, what the other runs keep live beside it, with every run at its current plan (``eager``:
    with every run unplanned, the step eager runs); complete for the runs from ``first`` on (the later runs need
    plans, the earlier ones do not). ``eager_code``: the call's code between the runs, when known (one more
    entry than ``runs``: before the first, after each run); ``arguments``: the storages the caller passed, when
    known (else every input no run made is taken for one).

    Runs go forward in order and backward in reverse order. Beside run i: every parameter and buffer of the call
    and every input the caller passed (held by the caller through the call) that i does not read, what each
    earlier run holds after its forward (less the outputs i reads, which its own profile counts as inputs) and
    the outputs the call let go before backward that their run does not hold after its forward, which i does not
    read but a later run reads or the caller held when the call returned, and what the eager code before i saved
    for backward (less what i reads); beside its backward also the gradients of the parameters of later runs and
    of the eager code after i. The parameters only eager code reads are live through the call. The later runs'
    highest peak (and that of the backward of the eager code after i) includes what run i holds, so it is given
    relative to that: a context does not depend on the run's own plan. Each context also carries the call's floor
    (:attr:`StepContext.floor_bytes <sublinear.core.profile.StepContext>`).
    """
    call = _CallStorages.of(runs, eager_code, arguments, eager)
    floor = call.state_bytes
    contexts, code_peaks = [], []
    held_before, earlier_outputs, let_go = 0, {}, {}
    for i, r in enumerate(runs):
        later_parameters: dict[int, int] = dict(call.gradients_after[i])
        read_later: set[int] = set()
        for later in runs[i + 1:]:
            later_parameters |= later.parameters
            read_later |= set(later.inputs)
        code_peaks.append(call.code_peak(i, held_before, later_parameters | r.parameters))
        floor = max(floor, code_peaks[-1] - held_before)  # the code's backward beside no graph's held bytes
        alive_let_go = sum(b for s, (b, by_caller, retained) in let_go.items()
                           if s not in r.inputs and not retained and (by_caller or s in read_later))
        beside_forward = (_sum_except(call.everything, r.state | r.inputs) + held_before + alive_let_go
                          + call.eager_beside_forward(i) - sum(b for s, b in r.inputs.items() if s in earlier_outputs))
        # an earlier run's output i reads that the call let go and no one else holds: gone when backward starts
        unsaved = r.unsaved_inputs()
        gone = sum(b for s, b in r.inputs.items() if s in let_go and not let_go[s][2] and s in unsaved)
        contexts.append(StepContext(beside_forward, beside_forward + _sum_except(later_parameters, r.state) - gone
                                    - call.made_gone_by_backward(i)))
        held_before += r.held_eager if eager else r.held
        outputs_let_go = r.let_go(eager)
        let_go |= outputs_let_go
        earlier_outputs |= {s: b for s, b in r.outputs.items() if s not in outputs_let_go or outputs_let_go[s][2]}
    code_peaks.append(call.code_peak(len(runs), held_before, {}))  # the code after the last run: its backward first
    floor = max(floor, code_peaks[-1] - held_before)
    later_peak = None
    for i in range(len(runs) - 1, first - 1, -1):
        if call.code[i + 1].backward:  # the code after run i: its backward's peak includes what run i holds
            later_peak = code_peaks[i + 1] if later_peak is None else max(later_peak, code_peaks[i + 1])
        held = runs[i].held_eager if eager else runs[i].held
        contexts[i] = dataclasses.replace(contexts[i], later_beyond_held=None if later_peak is None
                                          else later_peak - held, floor_bytes=floor)
        if i > first:
            peak = runs[i].variant.peak_beside(contexts[i], eager)
            later_peak = peak if later_peak is None else max(later_peak, peak)
    return contexts


@dataclass
class _MadeInput:
    """An input of some runs that the call's eager code made: live from its first reader's forward to its last
    reader's, and after that until the backward of the earliest reader whose autograd saves it."""

    nbytes: int
    readers: list[int]
    savers: list[int]

    def beside_forward(self, run: int) -> bool:
        return self.readers[0] < run and (run < self.readers[-1] or bool(self.savers))

    def at_backward(self, run: int) -> bool:
        """Live when the backward of ``run`` (or of the eager code before it) runs."""
        return any(saver < run for saver in self.savers)


@dataclass
class _CallStorages:
    """What one call holds beside its runs that no run's plan changes: ``everything`` live through the call (the
    parameters and buffers, and the caller's inputs), the inputs its eager code made, and what its eager code
    holds (see :class:`EagerCode`)."""

    runs: Sequence[GraphRun]
    everything: dict[int, int]
    made: dict[int, _MadeInput]
    code: Sequence[EagerCode]
    counted: set[int]  # storages counted beside the runs other than as saved by eager code
    saved_by_run: dict[int, int]  # input storage -> the first run whose autograd saves it (its held counts it)
    saved_before: list[dict[int, int]]  # per run, what the eager code before it saved
    gradients_after: list[dict[int, int]]  # per run, the gradients the eager code after it made

    @staticmethod
    def of(runs: Sequence[GraphRun], eager_code: Sequence[EagerCode], arguments: set[int] | None,
           eager: bool) -> _CallStorages:
        code = eager_code if len(eager_code) == len(runs) + 1 else [EagerCode()] * (len(runs) + 1)
        everything: dict[int, int] = {}
        produced: dict[int, int] = {}
        for r in runs:
            everything |= r.state
            produced |= r.outputs
        made: dict[int, _MadeInput] = {}
        for i, r in enumerate(runs):
            unsaved = r.unsaved_inputs()
            for s, b in r.inputs.items():
                if s in produced or s in everything:
                    continue
                if arguments is None or s in arguments:
                    everything[s] = b
                    continue
                made.setdefault(s, _MadeInput(b, [], [])).readers.append(i)
                if s not in unsaved:
                    made[s].savers.append(i)
        for c in code:
            everything |= c.parameters
        # an input the eager code saved is held from the code that made it to that code's backward, after the
        # backward of every run that reads it: counted as saved by eager code
        made = {s: m for s, m in made.items() if not any(s in c.saved for c in code)}
        counted = set(everything) | {s for s, m in made.items() if m.savers}
        for r in runs:
            if r.variant is not None and r.returned is not None:
                held = r.variant.outputs_held_after_forward(eager)
                counted |= {s for s, h in zip(r.returned.storages, held) if h}
        saved_by_run: dict[int, int] = {}  # input storage -> the first run whose autograd saves it
        for i, r in enumerate(runs):
            unsaved = r.unsaved_inputs()
            saved_by_run |= {s: i for s in r.inputs if s not in unsaved and s not in saved_by_run}
        saved_before, saved = [], {}
        for gap, c in enumerate(code[:len(runs)]):
            # what a run before the code saved, its held counts (that run's backward comes after the code's)
            saved = saved | {s: b for s, b in c.saved.items() if s not in counted and saved_by_run.get(s, gap) >= gap}
            saved_before.append(saved)
        gradients_after, gradients = [], {}
        for r, c in zip(reversed(runs), reversed(code[1:])):
            gradients = gradients | c.parameters
            gradients_after.append({s: b for s, b in gradients.items() if s not in r.state})
        return _CallStorages(runs, everything, made, code, counted, saved_by_run, saved_before, gradients_after[::-1])

    @property
    def state_bytes(self) -> int:
        """The call's parameters, buffers and inputs, and the gradients of its parameters (the runs' and those only
        its eager code reads): live when the step ends whatever the plans."""
        parameters: dict[int, int] = {}
        for r in self.runs:
            parameters |= r.parameters
        for c in self.code:
            parameters |= c.parameters
        return sum(self.everything.values()) + sum(parameters.values())

    def eager_beside_forward(self, run: int) -> int:
        """What the eager code holds beside ``run``'s forward: what the code before it saved and the inputs it made
        that are live, less those the run reads (its own profile counts them)."""
        inputs = self.runs[run].inputs
        return _sum_except(self.saved_before[run], inputs) + sum(
            m.nbytes for s, m in self.made.items() if s not in inputs and m.beside_forward(run))

    def made_gone_by_backward(self, run: int) -> int:
        """Of the inputs the eager code made beside ``run``'s forward, those gone when its backward runs."""
        inputs = self.runs[run].inputs
        return sum(m.nbytes for s, m in self.made.items()
                   if s not in inputs and m.beside_forward(run) and not m.at_backward(run))

    def code_peak(self, gap: int, held_before: int, gradients: dict[int, int]) -> int:
        """The step's peak in the backward of the eager code before run ``gap`` (``len(runs)``: after the last):
        beside what the runs before it hold (``held_before``), what the code before it saved, the made inputs
        still saved and ``gradients`` (those of the parameters whose backward ran before it); 0 where that code
        has no backward."""
        if not self.code[gap].backward:
            return 0
        saved = sum(self.saved_before[gap - 1].values()) if gap else 0
        made = sum(m.nbytes for m in self.made.values() if m.at_backward(gap))
        return (sum(self.everything.values()) + held_before + saved + made + sum(gradients.values())
                + self.code[gap].backward_peak(self.counted | {s for s, r in self.saved_by_run.items() if r < gap}))


def contexts_by_graph(runs: Sequence[GraphRun], eager: bool, eager_code: Sequence[EagerCode] = (),
                      arguments: set[int] | None = None) -> dict[str, StepContext]:
    """Per graph of a call of several runs, its :func:`step_contexts`; a graph run several times gets the widest."""
    found: dict[str, StepContext] = {}
    if len(runs) > 1:
        for run, context in zip(runs, step_contexts(runs, eager=eager, eager_code=eager_code, arguments=arguments)):
            code = run.runtime.graph.code
            found[code] = widest_context(found[code], context) if code in found else context
    return found


def losses_in(returned: Any) -> list[torch.Tensor]:
    """The tensors backward starts from in a call that returned ``returned``: the scalars among its floating tensors
    that need a gradient when there are any (a loss computed in forward), else every such tensor."""
    returned = [t for t in tree_leaves(returned)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return [t for t in returned if t.dim() == 0] or returned


def output_uses(runs: Sequence[GraphRun], returned: Any) -> list[tuple[str, ...]]:
    """Per run of one call that returned ``returned``, per tensor output: what the step did with it (see
    :func:`sublinear.profiling.graph.profile`). A later run reads it, or it is a loss (:func:`losses_in`); those get a
    gradient. Of the others, what is still alive after the call was held (a KV cache, a module attribute) and the
    rest was dropped when the graph returned."""
    losses = {t.untyped_storage()._cdata for t in losses_in(returned)}
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
                       max(later) if later else None, max(a.floor_bytes, b.floor_bytes))
