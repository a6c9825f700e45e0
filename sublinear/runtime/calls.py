"""Training calls as the backend sees them: which graphs each call ran, what the other graphs of the call hold beside
each one (:class:`~sublinear.core.profile.StepContext`), and what the call did with each graph's outputs."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sublinear.core.objective import Candidate
from sublinear.core.profile import StepContext
from sublinear.planners import BudgetError
from sublinear.planners.driver import step_floor
from sublinear.runtime.eager_code import EagerCode, eager_code_between
from sublinear.runtime.step import (
    GraphRun, contexts_by_graph, losses_in, output_uses, planned_knowing_later, step_contexts, uses_after_backward,
    widest_context,
)
from sublinear.runtime.variant import GraphVariant
from sublinear.training import combined_use

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime

__all__ = ["CallTracker", "UNSEEN", "upcoming_context"]

log = logging.getLogger("sublinear")

UNSEEN = object()  # finish() without the call's result (a bare torch.compile backend never sees it)


class _OverBudget:
    """Counts the calls in a row predicted, as they ran, above the budget at some graph (or that ran one at its
    lowest peak, having found no plan within the budget when it ran); BudgetError once a call planned settled
    (:data:`SETTLING_CALLS` such calls before it) still is: its graphs, each planned for the others as the calls
    before showed them, have no room left."""

    def __init__(self) -> None:
        self.calls = 0

    def after_call(self, variants: Iterable[GraphVariant]) -> None:
        over = [v for v in variants if v.budget is not None and (v.settling or v.peak_bytes > v.budget)]
        self.calls = self.calls + 1 if over else 0
        if self.calls > SETTLING_CALLS:
            self.calls = 0
            worst = max([v for v in over if v.settling] or over, key=lambda v: v.peak_bytes)  # at its lowest
            raise BudgetError(worst.objective, Candidate(worst.plan, worst.simulation), None,
                              floor=step_floor(worst.profile))


class CallTracker:
    """The graph runs of the current training call and of the last finished one. ``latest``: per graph (by code),
    the variant the last finished call ran, in the order it ran; ``uses``: per graph, what calls do with each output.
    ``explicit``: calls are marked by :meth:`begin` and :meth:`finish` (else the first graph of a call starts it)."""

    def __init__(self) -> None:
        self.current: list[GraphRun] = []
        self.previous: list[GraphRun] = []
        self.eager_code: list[EagerCode] = []  # the previous call's code between its runs (empty: unknown)
        self.arguments: set[int] | None = None  # the storages the current call's caller passed (None: unknown)
        self.previous_arguments: set[int] | None = None
        self.latest: dict[str, GraphVariant] = {}
        self.uses: dict[str, tuple[str, ...]] = {}
        self.unlearned: list[tuple[GraphRun, tuple[str, ...]]] = []  # the last call's runs, awaiting backward
        self.from_calls: dict[str, tuple[str, ...]] = {}  # per graph, the uses calls showed (not planning ahead)
        self.ahead = False  # the calls being finished are planning ahead on a data-less twin
        self.over_budget = _OverBudget()
        # Graphs the session captured. TorchDynamo's trackers of a frame it compiles reach the values the frame
        # saw through reference cycles until a garbage collection: what a call held of the outputs of runs before
        # a capture is unknown, and is learned from a later call.
        self.captures = 0
        self.explicit = False

    def begin(self, arguments: set[int] | None = None) -> None:
        self.current = []
        self.arguments = arguments
        self._learn_after_backward()

    def record(self, run: GraphRun) -> None:
        """A graph of the current call ran."""
        run.captures_before = self.captures
        self.current.append(run)

    def starts_again(self, code: str) -> bool:
        """Without explicit calls: whether a run of graph ``code`` begins a new call (the call's first graph runs
        again)."""
        return not self.explicit and bool(self.current) and self.current[0].runtime.graph.code == code

    def running(self) -> dict[str, GraphVariant]:
        """Per graph, the variant the current call ran (without explicit calls no end is seen: these describe it)."""
        return {run.runtime.graph.code: run.variant for run in self.current}

    def finish(self, returned: Any = UNSEEN) -> list[GraphRuntime]:
        """The call ended, returning ``returned``: give each graph the context of the call's other graphs and
        return the graphs to plan again: those profiled with a backward that differs from this call's (which
        outputs get gradients), those whose plan no longer meets the objective beside the others, and those planned
        before the later graphs were known."""
        runs, self.current = self.current, []
        if not runs:
            return []
        for run in runs:
            run.followed_by_capture = self.captures > run.captures_before
            if run.returned is not None and not run.followed_by_capture and not self.ahead:
                run.held_through_call = run.returned.alive()  # a data-less twin's call is not the caller's
        self.previous, self.previous_arguments = runs, self.arguments
        self.eager_code = _eager_code(runs, returned) if not self.ahead else []
        stale = self._learn_output_uses(runs, returned)
        contexts = contexts_by_graph(runs, eager=False, eager_code=self.eager_code, arguments=self.arguments)
        eager_contexts: dict[str, StepContext] | None = None  # made when a context changed: eager's, for the report
        self.latest = {}
        captured = any(run.followed_by_capture for run in runs)
        for run in runs:
            code, variant = run.runtime.graph.code, run.variant
            if code in self.latest:
                continue
            self.latest[code] = variant
            context = contexts.get(code)
            planned_in = variant.profile.step_context
            if variant.bound and context is not None and planned_in is not None:
                # A family's plan serves calls of every size up to its bound: what the other graphs hold at a
                # smaller call is no reason to plan again; what they hold beyond the context planned in is.
                context = widest_context(planned_in, context)
            if run.runtime in stale or (context == variant.profile.step_context and not variant.settling):
                continue
            if eager_contexts is None:
                eager_contexts = contexts_by_graph(runs, eager=True, eager_code=self.eager_code,
                                                   arguments=self.arguments)
            eager_context = eager_contexts.get(code)
            if variant.bound and context is not None and eager_context is not None:
                # eager beside the call's other graphs unplanned, in a context at least as wide as the plan's
                eager_context = widest_context(eager_context, context)
            variant.set_context(context, eager_context)
            unknown_later = variant.objective.memory_budget is not None and not planned_knowing_later(variant, context)
            if variant.settling or not variant.accepted or unknown_later:
                run.runtime.forget(variant)
                stale.append(run.runtime)
        if not self.ahead and not captured:  # a call that captured graphs planned them one by one, uninformed
            self.over_budget.after_call(self.latest.values())
        if stale:
            log.info("sublinear: planning %d graph(s) again for the step as this call ran it (%s)", len(stale),
                     "; ".join(str(self.latest[r.graph.code].profile.step_context) for r in stale))
        return stale

    def uses_seen(self, code: str) -> bool:
        """Whether a call (not planning ahead) showed what the caller does with graph ``code``'s outputs; a bare
        backend never sees a call's result, so there the guess (outputs held) is all there is."""
        return not self.ahead and (not self.explicit or code in self.from_calls)

    def _learn_output_uses(self, runs: Sequence[GraphRun], returned: Any) -> list[GraphRuntime]:
        """Record what the call did with each graph's outputs; forget the variants profiled otherwise and return
        their graphs. Where backward has yet to reach a graph, what the caller still holds then is known only after
        the call: the call's uses are then learned when the next call begins (:meth:`begin`), before its graphs
        run."""
        if returned is UNSEEN:
            return []
        uses = output_uses(runs, returned)
        if any(r.returned.awaits_backward and r.returned.alive_at_backward is None for r in runs if r.returned):
            self.unlearned = list(zip(runs, uses))
            return []
        return self._learn(list(zip(runs, uses)))

    def _learn_after_backward(self) -> None:
        """Learn the last call's uses now that its backward ran: an output held when the call returned but let go
        before backward reached its graph is dropped."""
        learned, self.unlearned = self.unlearned, []
        if learned:
            self._learn(learned)

    def _learn(self, learned_uses: list[tuple[GraphRun, tuple[str, ...]]]) -> list[GraphRuntime]:
        """Per run, the uses the call returning showed, as backward then found them (:func:`uses_after_backward`).
        A graph that runs several times gets, per output, the most demanding use of its runs; and of the calls
        learned from so far (what later graphs read can change from call to call, as an MoE's routing does), so a
        graph is planned again when a call shows a more demanding use, or outputs let go before backward that are
        worth more than :data:`LET_GO_WORTH` of its predicted peak."""
        learned_uses = [(run, uses) for run, uses in learned_uses if not run.followed_by_capture]
        learned: dict[str, tuple[str, ...]] = {}
        for run, at_return in learned_uses:
            code, uses = run.runtime.graph.code, uses_after_backward(at_return, run.returned)
            learned[code] = _most_demanding(learned.get(code, uses), uses)
        for code in learned:
            if code in self.from_calls:
                learned[code] = _most_demanding(self.from_calls[code], learned[code])
            if not self.ahead:
                self.from_calls[code] = learned[code]
        stale = []
        for run, _uses in learned_uses:
            code = run.runtime.graph.code
            if _worth_profiling_again(run, learned[code]) and run.runtime not in stale:
                self.uses[code] = learned[code]
                run.runtime.forget(run.variant)
                stale.append(run.runtime)
        return stale


SETTLING_CALLS = 2  # calls in a row that may run above the budget while the graphs are planned for each other


def upcoming_context(calls: CallTracker, runtime: GraphRuntime,
                     values: Sequence[Any]) -> tuple[StepContext | None, bool]:
    """The context of ``runtime``'s graph about to run next in the current call: this call's earlier graphs as
    they ran, the later ones as the previous call ran them (None when it runs alone); and whether the call is
    settled: every other graph of it runs its final plan (each earlier one planned knowing the graphs after it,
    each later one too, and none of them taking its lowest peak for now), or :data:`SETTLING_CALLS` calls in a row
    ran above the budget (graphs that take turns waiting on each other, or whose contexts change from call to
    call, as an MoE's routing changes them, settle no other way). A graph planned in an unsettled call
    may yet fit once the others are planned for it: what the earlier ones hold and the later ones' peaks are
    their plans'."""
    position, earlier, previous = len(calls.current), calls.current, calls.previous
    same_place = len(previous) > position and previous[position].runtime.graph.code == runtime.graph.code
    later = previous[position + 1:] if same_place else []
    settled = calls.over_budget.calls >= SETTLING_CALLS or \
        all(_final(r, last=r is later[-1] if later else False) for r in [*earlier, *later])
    if not earlier and not later:
        return None, settled
    upcoming = GraphRun.of(runtime, None, values)
    if same_place:  # the later runs read its outputs as the previous call made them
        made = previous[position]
        upcoming.outputs, upcoming.returned, upcoming.held_through_call = \
            made.outputs, made.returned, made.held_through_call
    runs = [*earlier, upcoming, *later]
    eager_code = calls.eager_code if len(runs) == len(previous) else ()  # as the previous call ran it
    arguments = None if calls.arguments is None or calls.previous_arguments is None and later else \
        calls.arguments | (calls.previous_arguments or set())  # the later runs read the previous call's
    return step_contexts(runs, first=position, eager_code=eager_code, arguments=arguments)[position], settled


def _eager_code(runs: Sequence[GraphRun], returned: Any) -> list[EagerCode]:
    """The code the call ran eagerly between its graph runs, where the autograd graph of what it returned shows
    it (empty where the call ran one graph, or its result or its runs' node numbers are unknown)."""
    if len(runs) < 2 or returned is UNSEEN or any(r.nodes is None for r in runs):
        return []
    return eager_code_between([r.nodes for r in runs], losses_in(returned))


def _final(run: GraphRun, last: bool) -> bool:
    """Whether ``run``'s variant is its graph's plan for good: planned knowing the graphs after it (``last``: there
    are none), not a lowest peak taken until the others are planned for it (unless the same again after they were:
    ``stuck``), and still its graph's variant."""
    variant = run.variant
    current = any(v is variant for v in run.runtime.variants.values())  # by identity: variants hold arrays
    return variant is not None and (not variant.settling or variant.stuck) and current and (
        last or variant.planned_in is not None and variant.planned_in.later_beyond_held is not None)


LET_GO_WORTH = 0.01  # outputs newly let go before backward below this share of the peak: the profile is kept


def _worth_profiling_again(run: GraphRun, uses: tuple[str, ...]) -> bool:
    """Whether ``run``'s variant must be profiled again for ``uses``: they demand more of some output (its
    prediction would be low), or they let go before backward outputs worth more than :data:`LET_GO_WORTH` of its
    peak (its prediction is high by at most their bytes)."""
    old = run.variant.uses
    if old == uses:
        return False
    if any(combined_use(a, b) != a for a, b in zip(old, uses)):
        return True
    nbytes = run.returned.nbytes if run.returned is not None else ()
    let_go = sum(b for a, u, b in zip(old, uses, nbytes) if a != u)
    return let_go > LET_GO_WORTH * run.variant.peak_bytes


def _most_demanding(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(combined_use(x, y) for x, y in zip(a, b))
