"""LM-head chunks grown into the memory a plan leaves under its memory budget.

At capture, a chunked LM head gets the fewest rows per chunk whose passes over the head's weight cost little time
(:func:`sublinear.capture.lm_head.chunk_rows`): the least memory. Under a budget, the chosen plan often leaves memory
free at the head, and larger chunks pass over the weight fewer times. Once a plan is chosen, each head's chunk grows
to the most rows (whole multiples of 8, up to every token) at which the plan's predicted peak stays within the budget
less :data:`HEADROOM` of it; the variant runs its graph with those chunks, and its profile counts the head op's
larger scratch. Growth never shrinks a chunk nor changes the plan. A dynamic graph's plan is made at the sizes
of its bound (the largest it serves), so a head whose token count varies grows at the bound's count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sympy

from sublinear.capture.lm_head import ROW_MULTIPLE, LMHead
from sublinear.capture.shapes import SymbolicSizes
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.simulation.timeline import simulate

__all__ = ["HEADROOM", "HeadChunks", "grown_head_chunks"]

HEADROOM = 1 / 64  # of the budget, kept free by growth: a prediction a little short must not take the step over


@dataclass(frozen=True)
class HeadChunks:
    """A variant's rows per chunk for each chunked head (in graph order), and the bytes each head's op holds in
    forward beyond what the profile (profiled at the captured chunks) counts: ``(op, bytes)``."""

    rows: tuple[int, ...]
    added: tuple[tuple[int, int], ...]

    def applied(self, profile: GraphProfile) -> GraphProfile:
        """``profile`` (at the captured chunks) with the head ops' scratch at these chunks."""
        return self._shifted(profile, 1)

    def undone(self, profile: GraphProfile) -> GraphProfile:
        """``profile`` (at these chunks) with the head ops' scratch at the captured chunks."""
        return self._shifted(profile, -1)

    def _shifted(self, profile: GraphProfile, sign: int) -> GraphProfile:
        ops = list(profile.ops)
        for o, added in self.added:
            ops[o] = dataclasses.replace(ops[o], forward_extra_bytes=ops[o].forward_extra_bytes + sign * added)
        return dataclasses.replace(profile, ops=ops)


def grown_head_chunks(heads: Sequence[LMHead], head_ops: Sequence[int], profile: GraphProfile, plan: Plan,
                      budget: int | None, sizes: SymbolicSizes | None = None,
                      bound: Mapping[str, int] | None = None) -> HeadChunks | None:
    """The chunks of the chunked ``heads`` (whose ops in ``profile`` are ``head_ops``) grown as far as ``plan``'s
    predicted peak stays within ``budget`` less the headroom; None where none grows. A dynamic graph's heads (its
    ``sizes``) grow at the token counts of ``bound``, the sizes it was profiled at."""
    heads = [head for head in heads if head.chunked]
    tokens = [_tokens(head, sizes, bound or {}) for head in heads]
    if budget is None or not heads or len(head_ops) != len(heads) or None in tokens:
        return None
    limit = budget - int(budget * HEADROOM)
    chunks = HeadChunks(tuple(head.rows for head in heads), ())
    if simulate(profile, plan).peak_bytes > limit:
        return None
    for k, (head, op, count) in enumerate(zip(heads, head_ops, tokens)):
        captured = head.scratch(head.rows, count)

        def with_rows(rows: int, k: int = k, op: int = op, count: int = count, captured: int = captured) -> HeadChunks:
            counts = chunks.rows[:k] + (rows,) + chunks.rows[k + 1:]
            return HeadChunks(counts, (*chunks.added, (op, head.scratch(rows, count) - captured)))

        candidates = [*range(head.rows, count, ROW_MULTIPLE), count] if count > head.rows else [head.rows]
        low, high = 0, len(candidates) - 1  # candidates[low] fits (the captured chunk, or the last that fitted)
        while low < high:
            middle = (low + high + 1) // 2
            if simulate(with_rows(candidates[middle]).applied(profile), plan).peak_bytes <= limit:
                low = middle
            else:
                high = middle - 1
        chunks = with_rows(candidates[low])
    if chunks.rows == tuple(head.rows for head in heads):
        return None
    return chunks


def _tokens(head: LMHead, sizes: SymbolicSizes | None, bound: Mapping[str, int]) -> int | None:
    """The head's token count at ``bound`` (its count at capture where it is fixed); None where unknown."""
    if not head.token_expression:
        return head.tokens
    if sizes is None:
        return None
    expression = sympy.sympify(sizes.rename(head.token_expression))
    value = expression.subs({sympy.Symbol(name): v for name, v in bound.items()})
    return int(value) if value.is_number else None
