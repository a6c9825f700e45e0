"""What the code a training call runs eagerly between its graphs (TorchDynamo runs the code at a graph break
eagerly) holds, read from the autograd graph the call built: what it saves for backward, the parameters whose
gradients its backward makes, and its backward's gradients node by node. The step's memory beside each graph
includes it, though no plan changes it."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BackwardStep", "EagerCode", "eager_code_between", "next_node"]


@dataclass(frozen=True)
class BackwardStep:
    """One autograd node of eager code as backward runs it (the latest made first, as autograd's engine picks
    among the nodes ready to run)."""

    allocates: int  # the gradients it makes, live beside its incoming ones while it runs
    keeps: int  # of those, what outlives it: the first gradient into a node's slot, or of a parameter
    frees: int  # its incoming gradients, freed when it ends
    releases: tuple[int, ...]  # storages saved for backward whose last reader it is, freed when it ends


@dataclass(frozen=True)
class EagerCode:
    """The eager code between two graph runs of a call (or before the first, or after the last).

    saved: storages its autograd nodes saved for backward (not parameters) -> bytes; held until its backward,
        which runs after the backward of every later graph run and before that of every earlier one.
    parameters: storages of the parameters its backward gives a gradient -> bytes (a gradient has its
        parameter's size): live from its backward to the step's end, and with the parameters through the step.
    incoming: the gradients waiting for its nodes when its backward starts (made by the code after it).
    backward: its nodes as its backward runs them.
    """

    saved: dict[int, int] = field(default_factory=dict)
    parameters: dict[int, int] = field(default_factory=dict)
    incoming: int = 0
    backward: tuple[BackwardStep, ...] = ()

    def backward_peak(self, counted: set[int]) -> int:
        """The most its backward holds at once: its saved storages (less ``counted``, live anyway), its incoming
        gradients and those its nodes make; 0 for code with no backward."""
        if not self.backward:
            return 0
        saved = {s: b for s, b in self.saved.items() if s not in counted}
        live = peak = sum(saved.values()) + self.incoming
        for step in self.backward:
            peak = max(peak, live + step.allocates)
            live += step.keeps - step.frees - sum(saved.get(s, 0) for s in step.releases)
        return peak


def next_node() -> int:
    """The sequence number autograd gives the next node it makes (node numbers rise in the order nodes are made
    on a thread), which places each node of a call before, inside or after each graph run."""
    return torch._C._autograd._get_sequence_nr()


def eager_code_between(spans: Sequence[tuple[int, int]], losses: Sequence[torch.Tensor]) -> list[EagerCode]:
    """Per gap between the graph runs whose autograd nodes were numbered in ``spans`` (each run's first number and
    the number after its last), in order: the eager code before the first run, between each two, and after the last
    (``len(spans) + 1`` entries), as the autograd graph backward runs from ``losses`` shows it. A saved storage is
    counted once, in the first gap whose nodes save it; a parameter's gradient is kept by the gap whose backward
    makes it first."""
    starts = [start for start, _ in spans]
    nodes = sorted(_nodes_from(losses), key=lambda n: n._sequence_nr())
    gap_of: dict[int, int | None] = {}
    for node in nodes:
        number = node._sequence_nr()
        gap = bisect.bisect_right(starts, number)
        gap_of[id(node)] = None if gap and number < spans[gap - 1][1] else gap  # None: a graph run's own node
    members: list[list[Any]] = [[] for _ in range(len(spans) + 1)]
    for node in nodes:
        if gap_of[id(node)] is not None:
            members[gap_of[id(node)]].append(node)
    saved_of = {id(node): _storages(_saved_tensors(node)) for gap in members for node in gap}  # each read once
    saved_first: set[int] = set()
    saved = [_saved_storages(gap, saved_first, saved_of) for gap in members]
    incoming = _slots_fed_from_outside(nodes, gap_of)
    parameters = [_parameters(gap) for gap in members]
    all_parameters = {s for found in parameters for s in found}
    made: set[int] = set()  # parameters given a gradient by the code after (backward runs the latest code first)
    code = [EagerCode() for _ in members]
    for gap in reversed(range(len(members))):
        steps = _backward_steps(members[gap], gap, gap_of, incoming, made, saved_of)
        code[gap] = EagerCode({s: b for s, b in saved[gap].items() if s not in all_parameters}, parameters[gap],
                              sum(b for (node, _), b in incoming.items() if gap_of.get(node) == gap), steps)
    return code


def _nodes_from(losses: Sequence[torch.Tensor]) -> list[Any]:
    """Every autograd node backward from ``losses`` reaches (AccumulateGrad nodes left out)."""
    stack = [t.grad_fn for t in losses if t.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or _accumulates(node):
            continue
        seen[id(node)] = node
        stack.extend(next_ for next_, _ in node.next_functions)
    return list(seen.values())


def _accumulates(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def _parameters(gap: Sequence[Any]) -> dict[int, int]:
    """The parameters the nodes of ``gap`` give gradients: storage -> bytes."""
    found = {}
    for node in gap:
        for next_, _ in node.next_functions:
            if next_ is not None and _accumulates(next_):
                storage = next_.variable.untyped_storage()
                found[storage._cdata] = storage.nbytes()
    return found


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Storage key -> bytes of ``tensors``."""
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _saved_storages(gap: Sequence[Any], counted: set[int], saved_of: dict[int, dict[int, int]]) -> dict[int, int]:
    """The storages the nodes of ``gap`` saved (``saved_of``: per node id) that no earlier gap did (``counted``,
    which this extends)."""
    found = {}
    for node in gap:
        for key, nbytes in saved_of[id(node)].items():
            if key not in counted:
                counted.add(key)
                found[key] = nbytes
    return found


def _slots_fed_from_outside(nodes: Sequence[Any], gap_of: dict[int, int | None]) -> dict[tuple[int, int], int]:
    """The gradient slots of eager code's nodes (node id, input) filled by later code (another gap, a graph run, or
    the loss itself), which hold their gradients when the node's gap's backward starts: slot -> bytes."""
    fed: dict[tuple[int, int], int] = {}
    targeted: set[int] = set()
    for node in nodes:
        for next_, slot in node.next_functions:
            if next_ is None or _accumulates(next_):
                continue
            targeted.add(id(next_))
            if gap_of.get(id(next_)) is not None and gap_of.get(id(next_)) != gap_of[id(node)]:
                fed[(id(next_), slot)] = _slot_bytes(next_, slot)
    for node in nodes:  # a loss's node: backward starts by filling it
        if id(node) not in targeted and gap_of[id(node)] is not None:
            fed |= {(id(node), slot): _slot_bytes(node, slot) for slot in range(_slots(node))}
    return fed


def _backward_steps(gap: Sequence[Any], index: int, gap_of: dict[int, int | None],
                    incoming: dict[tuple[int, int], int], made: set[int],
                    saved_of: dict[int, dict[int, int]]) -> tuple[BackwardStep, ...]:
    """``gap``'s nodes as backward runs them, latest made first; ``made`` (the parameters given a gradient so far)
    is extended."""
    filled = {slot: b for slot, b in incoming.items() if gap_of.get(slot[0]) == index}
    last_reader: dict[int, int] = {}
    for node in gap:  # in the order made: the earliest-made reader runs last
        for key in saved_of[id(node)]:
            last_reader.setdefault(key, id(node))
    released: dict[int, list[int]] = {}  # node id -> the storages it reads last
    for key, reader in last_reader.items():
        released.setdefault(reader, []).append(key)
    steps = []
    for node in reversed(gap):
        allocates = keeps = 0
        for next_, slot in node.next_functions:
            if next_ is None:
                continue
            if _accumulates(next_):
                storage = next_.variable.untyped_storage()
                allocates += storage.nbytes()
                keeps += storage.nbytes() if storage._cdata not in made else 0
                made.add(storage._cdata)
                continue
            nbytes = _slot_bytes(next_, slot)
            allocates += nbytes
            if (id(next_), slot) not in filled:
                filled[(id(next_), slot)] = nbytes
                keeps += nbytes
        frees = sum(filled.pop((id(node), slot), 0) for slot in range(_slots(node)))
        steps.append(BackwardStep(allocates, keeps, frees, tuple(released.get(id(node), ()))))
    return tuple(steps)


def _slots(node: Any) -> int:
    try:
        return len(node._input_metadata)
    except (AttributeError, RuntimeError):
        return 0


def _slot_bytes(node: Any, slot: int) -> int:
    """The bytes of the gradient ``node`` receives at input ``slot`` (0 where its metadata does not say)."""
    try:
        metadata = node._input_metadata[slot]
        if metadata.is_nested_tensor or metadata.is_cpp_nested_tensor:
            return 0
        return int(torch.Size(metadata.shape).numel()) * metadata.dtype.itemsize
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return 0


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors ``node`` saved for backward and holds itself (a built-in node's saved fields, an autograd.Function's
    saved tensors), read without unpacking them; none where backward already freed them. A tensor saved under
    saved-tensor hooks is left out: unpacking runs the hook (a non-reentrant checkpoint re-runs its region, BatchNorm
    statistics and all; ``save_on_cpu`` copies the tensor back), and what the hook holds is not the tensor."""
    values = []
    for name in _saved_fields(type(node)):
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed by a backward that ran
            continue
        for saved in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(saved, torch._C._autograd.SavedTensor):
                saved = saved.data if saved.unpack_hook is None else None
            values.append(saved)
    return [t for t in values if isinstance(t, torch.Tensor)]


@functools.cache
def _saved_fields(node_type: type) -> tuple[str, ...]:
    """The fields of a node type that hold the tensors it saved, in their raw form (``_raw_saved_*``), which is read
    without unpacking them."""
    return tuple(n for n in dir(node_type) if n.startswith("_raw_saved_"))
