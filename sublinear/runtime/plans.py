"""What a plan says, for people: the latest call's plans (:class:`SublinearPlan`), per graph
(:class:`GraphPlan`) and per block (:class:`BlockSummary`), and a point of a plan's memory/time trade-off
(:class:`ParetoPoint`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


from sublinear.capture.attention import describe_sites
from sublinear.capture.dynamo import (CapturedGraph, GraphBreak, input_signature)
from sublinear.core.analysis import analyse
from sublinear.core.objective import Objective, Simulation, ratio_over
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.core.units import format_bytes
from sublinear.planners import PlanningResult
from sublinear.capture.shapes import Binding, describe_binding


@dataclass(frozen=True)
class ParetoPoint:
    plan: Plan
    peak_bytes: int
    recompute_flops: int
    flops_ratio: float  # step FLOPs relative to eager
    time_ratio: float  # predicted step time relative to eager
    graph_code: str  # the graph the plan belongs to (for SublinearModule.use)


@dataclass(frozen=True)
class BlockSummary:
    """One block of a plan, by op names (module path and node)."""

    index: int
    first_op: str
    last_op: str
    recomputed_ops: tuple[str, ...]  # re-run in backward
    kept_ops: tuple[str, ...]  # inside the block but never recomputed (chosen or pinned)
    retained_bytes: int  # storages the block retains for backward or later blocks
    recompute_seconds: float
    soft_end: bool  # the boundary is rebuilt, not retained (nested blocks)

    def __str__(self) -> str:
        parts = [f"block {self.index}: {self.first_op} .. {self.last_op}; retains {format_bytes(self.retained_bytes)}"]
        if self.recomputed_ops:
            parts.append(f"recomputes {len(self.recomputed_ops)} ops ({self.recompute_seconds * 1e3:.2f} ms)")
        if self.kept_ops:
            parts.append("kept ops: " + ", ".join(self.kept_ops[:4]) + (" ..." if len(self.kept_ops) > 4 else ""))
        if self.soft_end:
            parts.append("soft end: what crosses it is rebuilt, not retained")
        return "; ".join(parts)


@dataclass(frozen=True)
class GraphPlan:
    """The plan one captured graph runs at one call signature, with its predictions."""

    graph: int  # position of the graph among those the call ran
    signature: str  # the graph's non-parameter inputs: shape, dtype, device
    plan: Plan
    num_ops: int
    blocks: tuple[BlockSummary, ...]
    predicted_peak_bytes: int
    baseline_peak_bytes: int  # eager
    recompute_seconds: float
    eager_seconds: float
    recompute_flops: int
    step_flops: int
    objective: str
    origin: str  # the planner whose plan won (or "cache", "use()")
    cost_source: str
    history: tuple[tuple[int, float], ...]  # best (peak bytes, time ratio) so far after each planner/generation
    planning_seconds: float  # profile + search
    search_seconds: float  # the search alone; 0 for a cache hit
    from_cache: bool
    compiled_peak_bytes: int | None = None  # the graph alone, as its compiled forward and backward hold memory
    predicted_before_compile_bytes: int | None = None  # the predicted peak before its code was compiled and read
    executor: str = ""  # what runs the graph: "inductor", or "sublinear's eager executor (why)"
    lm_heads: tuple[str, ...] = ()  # each cross-entropy found: its LM head chunked, or why it was left alone
    attention: tuple[str, ...] = ()  # the attentions found: which were fused, which left alone and why

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def time_ratio(self) -> float:
        return ratio_over(self.recompute_seconds, self.eager_seconds)

    @property
    def flops_ratio(self) -> float:
        return ratio_over(self.recompute_flops, self.step_flops)

    def __str__(self) -> str:
        nested = f" ({len(self.plan.soft)} nested)" if self.plan.soft else ""
        compiled = " (as compiled)" if self.compiled_peak_bytes is not None else ""
        return (f"graph {self.graph} at {self.signature}: {self.num_blocks} blocks{nested} over {self.num_ops} ops, "
                f"predicted peak {format_bytes(self.predicted_peak_bytes)}{compiled} vs eager "
                f"{format_bytes(self.baseline_peak_bytes)}, step time x{self.time_ratio:.3f} (FLOPs "
                f"x{self.flops_ratio:.3f}); {self.objective}; by {self.origin}{' (cache)' if self.from_cache else ''}"
                + (f"; runs on {self.executor}" if self.executor else "")
                + "".join(f"; {head}" for head in self.lm_heads) + "".join(f"; {line}" for line in self.attention))

    def describe(self) -> str:
        return "\n".join([str(self), *(f"  {b}" for b in self.blocks)])


@dataclass(frozen=True)
class SublinearPlan:
    """What the latest training call ran: one :class:`GraphPlan` per captured graph, and the graph breaks (each
    distinct place and reason once). ``runs``: how many times the call ran a graph (a graph in a loop runs several
    times; 0 when not known)."""

    graphs: tuple[GraphPlan, ...]
    breaks: tuple[GraphBreak, ...] = ()
    runs: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.graphs)

    @property
    def num_ops(self) -> int:
        return sum(g.num_ops for g in self.graphs)

    @property
    def predicted_peak_bytes(self) -> int:
        return max((g.predicted_peak_bytes for g in self.graphs), default=0)

    @property
    def baseline_peak_bytes(self) -> int:
        return max((g.baseline_peak_bytes for g in self.graphs), default=0)

    @property
    def time_ratio(self) -> float:
        return ratio_over(sum(g.recompute_seconds for g in self.graphs), sum(g.eager_seconds for g in self.graphs))

    @property
    def recompute_flops(self) -> int:
        return sum(g.recompute_flops for g in self.graphs)

    @property
    def flops_ratio(self) -> float:
        return ratio_over(self.recompute_flops, sum(g.step_flops for g in self.graphs))

    @property
    def from_cache(self) -> bool:
        return bool(self.graphs) and all(g.from_cache for g in self.graphs)

    def to_plan(self) -> Plan:
        """The plan of the only graph."""
        if len(self.graphs) != 1:
            raise ValueError(f"the model runs {len(self.graphs)} graphs; pick one from .graphs")
        return self.graphs[0].plan

    @property
    def headline(self) -> str:
        """Graphs, blocks, predicted peak against eager's, predicted step time: one line."""
        runs = f" ({self.runs} graph runs)" if self.runs > len(self.graphs) else ""
        breaks = f" at {len(self.breaks)} graph break(s)" if self.breaks else ""
        return (f"{len(self.graphs)} graph(s){runs}{breaks}, {self.num_blocks} blocks: predicted peak "
                f"{format_bytes(self.predicted_peak_bytes)} vs eager {format_bytes(self.baseline_peak_bytes)}, "
                f"step time x{self.time_ratio:.3f} (FLOPs x{self.flops_ratio:.3f})")

    def __str__(self) -> str:
        if len(self.graphs) == 1 and not self.breaks:
            return str(self.graphs[0])
        lines = [self.headline, *(f"  {g}" for g in self.graphs)]
        lines += [f"  graph break at {b}" for b in self.breaks]
        return "\n".join(lines)

    def describe(self) -> str:
        """Every block of every graph: which layers end blocks, which are recomputed and which are kept."""
        return "\n".join([*(g.describe() for g in self.graphs), *(f"graph break at {b}" for b in self.breaks)])


def summarise_plan(index: int, values: Sequence[Any], graph: CapturedGraph, profile_: GraphProfile, plan: Plan,
                   result: PlanningResult | None, sim: Simulation, eager: Simulation, origin: str, objective: Objective,
                   planning_seconds: float, from_cache: bool, history: tuple[tuple[int, float], ...],
                   bound: Binding) -> GraphPlan:
    """The :class:`GraphPlan` of graph ``index`` called with ``values``: ``plan``'s blocks by op names, and ``sim``'s
    predictions against ``eager``'s."""
    a = analyse(profile_, plan)
    blocks = []
    for b, ops in enumerate(plan.blocks()):
        recomputed = tuple(profile_.ops[o].name for o in a.closure[b])
        kept = tuple(profile_.ops[o].name for o in ops if not a.recomputed[o] and b != plan.num_blocks - 1)
        mask = a.retained & (a.block_of[profile_.storage_producer] == b) if len(profile_.storage_producer) else []
        blocks.append(BlockSummary(index=b, first_op=profile_.ops[ops[0]].name, last_op=profile_.ops[ops[-1]].name,
                                   recomputed_ops=recomputed, kept_ops=kept,
                                   retained_bytes=int(profile_.storage_bytes[mask].sum()) if len(mask) else 0,
                                   recompute_seconds=float(profile_.op_seconds[a.closure[b]].sum()),
                                   soft_end=ops[-1] in plan.soft))
    inputs = [v for k, v in zip(graph.kinds, values) if k == "input"]
    signature = input_signature(inputs).describe(graph.model_device)
    if bound:
        signature += f" (a dynamic graph planned for {describe_binding(bound)})"
    return GraphPlan(graph=index, signature=signature, plan=plan, num_ops=profile_.num_ops, blocks=tuple(blocks),
                     predicted_peak_bytes=sim.peak_bytes, baseline_peak_bytes=eager.peak_bytes,
                     recompute_seconds=sim.recompute_seconds, eager_seconds=sim.eager_seconds,
                     recompute_flops=sim.recompute_flops, step_flops=profile_.step_flops,
                     objective=objective.describe(), origin=origin, cost_source=profile_.cost_source,
                     history=history, planning_seconds=planning_seconds,
                     search_seconds=result.seconds if result is not None and not from_cache else 0.0,
                     from_cache=from_cache, lm_heads=tuple(str(head) for head in graph.lm_heads),
                     attention=describe_sites(graph.attention))
