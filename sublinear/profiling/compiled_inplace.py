"""Where inductor writes a backward kernel's result into the buffer of a value it reads (``# reuse``), as the
compiled step's profile counts it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for

from sublinear.capture.joint import data_inputs, is_view
from sublinear.profiling.compiled_dataflow import StorageReads, StepStorages
from sublinear.profiling.compiled_nodes import LibraryCalls, storage_key_of, tensor_leaves
from sublinear.profiling.compiled_realize import same_elements
from sublinear.tensors import size_hint as hint

if TYPE_CHECKING:
    from sublinear.profiling.compiled_costs import GradientSide

__all__ = ["InPlace"]


class InPlace:
    """Inductor writes a buffer into one its computation reads (the value and the fused values without a buffer it
    is made from) when that computation reads it last and the sizes match: a buffer backward made, or a forward
    value backward alone reads (AOTAutograd donates saved intermediates to backward); never a graph input
    (parameters, inputs, the outputs' gradients) or a value forward returns. A forward value that is no buffer where
    a plan re-runs it is taken last: a GELU's backward writes into its output gradient where backward re-runs the
    GELU's fused values inside that kernel. A taken gradient-side buffer passes its
    bytes on. A taken forward value is recorded (``forward_taken``, with its reader's rank): whether it is a buffer
    there depends on the plan (saved, or rebuilt into a buffer, or fused into that kernel when recomputed), so the
    simulator ends it there, and the output counts on the gradient side (:meth:`held_forward` above it)."""

    def __init__(self, storages: StepStorages, side: GradientSide, reads: StorageReads,
                 fused_when_rebuilt: set[int], calls: LibraryCalls, fw: list[fx.Node]) -> None:
        self.storages, self.side, self.reads = storages, side, reads
        self.fused_when_rebuilt, self.calls, self.fw = fused_when_rebuilt, calls, fw
        self.given: set[int] = set()  # gradient-side buffers an output took
        self.forward_taken: dict[int, int] = {}

    def _size(self, key: int) -> int | None:
        if key in self.storages.produced_by:
            return None if key in self.reads.output_use or key in self.forward_taken else self.storages.size_of[key]
        born = self.side.born.get(key)
        if born is None or born < 0 or key in self.given or not self.side.buffer(key) or key in self.side.outputs:
            return None
        return self.side.sizes[key]

    def _fits(self, out: int, key: int) -> bool:
        produced = self.storages.produced_by
        into = self.fw[produced[key]] if key in produced else self.side.bw[self.side.born[key]]
        value = next((t for t in tensor_leaves(into.meta.get("val")) if storage_key_of(t) == key), None)
        return self.calls.fits(self.side.bw[self.side.born[out]], key, value)

    def _computation(self, k: int) -> set[int]:
        """Backward node ``k`` and the fused backward values without a buffer that its kernel computes with it."""
        side, found, stack = self.side, {k}, [k]
        while stack:
            for arg in data_inputs(side.bw[stack.pop()]):
                for key in self.storages.keys_of(arg):
                    j = side.born.get(key)
                    if j is not None and j >= 0 and j not in found and not side.buffer(key):
                        found.add(j)
                        stack.append(j)
        return found

    def _loads(self, k: int) -> list[int]:
        """The buffers backward node ``k``'s kernel loads, in the order its expression loads them: depth first
        through the fused values without a buffer it is made from, each node's arguments in order. Inductor writes
        in place into the first of its reads that allows it."""
        side, found, seen = self.side, [], set()
        stack = list(reversed(data_inputs(side.bw[k])))
        while stack:
            arg = stack.pop()
            keys = self.storages.keys_of(arg)
            if keys and all(side.born.get(key, -1) >= 0 and not side.buffer(key) for key in keys):
                if arg not in seen:
                    seen.add(arg)
                    stack += reversed(data_inputs(arg))
            else:
                found += [key for key in keys if key not in found]
        return found

    def _read_as_written(self, key: int, out: int) -> bool:
        """Whether the kernel computing ``out`` reads ``key`` only where it writes ``out``, element for element:
        inductor writes in place only where the read's index is the write's, so never into a value read through a
        slice or a transposed view (a scan's levels, read in even and odd halves), nor through a fused value whose
        elements a view moves on the way to ``out`` (a transpose copied out)."""
        side, storages = self.side, self.storages
        made = side.bw[side.born[out]]
        written = next(t for t in tensor_leaves(made.meta.get("val")) if storage_key_of(t) == out)
        stack, seen = [(made, False)], {made}
        while stack:
            node, moved = stack.pop()
            for arg in data_inputs(node):
                keys = storages.keys_of(arg)
                if key in keys:
                    if moved or not _indexed_alike(arg.meta.get("val"), written):
                        return False
                elif arg not in seen and (is_view(arg) or all(k in side.born and not side.buffer(k) for k in keys)):
                    seen.add(arg)  # computed inside the kernel: its reads are the kernel's
                    stack.append((arg, moved or not same_elements(node, arg)))
        return True

    def held_forward(self, taken: dict[int, int], rank: int) -> int:
        """Bytes of the outputs of ``taken`` (one kernel's) written into forward values whose reader's rank is below
        ``rank``: the kernel, which allocates its outputs before it runs, runs the backward of ``rank`` too (views of
        the library call's result before it, a transposed gradient's copy), and those values are still held on the
        forward side there, in that memory."""
        return sum(self.side.sizes[out] for out, key in taken.items()
                   if key in self.forward_taken and self.forward_taken[key] < rank)

    def take(self, segment: list[int], made: list[int]) -> dict[int, int]:
        """Per output of ``segment`` (one fused kernel, consecutive backward nodes) written in place: the input whose
        buffer it takes."""
        side = self.side
        if len(segment) == 1 and side.kinds.extern(side.bw[segment[0]]):
            return {}
        taken: dict[int, int] = {}
        for out in made:
            if side.bw[side.born[out]].target is torch.ops.aten.cat.default:
                continue  # a concatenation's buffer is allocated for its parts to be written into
            computation = self._computation(side.born[out])
            inputs = [key for key in self._loads(side.born[out])
                      if side.last[key] in computation and self._size(key) is not None]
            inputs.sort(key=lambda key: key in self.fused_when_rebuilt)  # which a plan may make no buffer
            match = next((key for key in inputs if key not in taken.values() and key != out
                          and self._size(key) == self.side.sizes[out] and self._fits(out, key)
                          and self._read_as_written(key, out)), None)
            if match is None:
                continue
            taken[out] = match
            if match in self.storages.produced_by:
                self.forward_taken[match] = self.reads.rank_of_backward[self.reads.last_backward_read[match]]
            else:
                self.given.add(match)
        return taken


def _indexed_alike(read: object, written: torch.Tensor) -> bool:
    """Whether ``read`` and ``written`` index their buffers alike: both from its start over the same elements,
    of one shape and strides, or both contiguous."""
    if not isinstance(read, torch.Tensor) or hint(read.storage_offset()) or hint(written.storage_offset()):
        return False
    shapes = [tuple(hint(s) for s in t.shape) for t in (read, written)]
    strides = [tuple(hint(s) for s in t.stride()) for t in (read, written)]
    if shapes[0] == shapes[1] and strides[0] == strides[1]:
        return True
    return all(_contiguous(shape, stride) for shape, stride in zip(shapes, strides)) \
        and math.prod(shapes[0]) == math.prod(shapes[1])


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return all(size == 1 or step == want for size, step, want in zip(shape, stride, make_contiguous_strides_for(shape)))
