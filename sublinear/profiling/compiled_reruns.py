"""What a plan's re-runs change in the compiled backward: where a re-run value is made beside the gradient side, and
which backward kernels it is fused into."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from torch import fx

from sublinear.capture.joint import JointGraph, data_inputs
from sublinear.profiling.compiled_costs import BackwardWalk, GradientSide
from sublinear.profiling.compiled_dataflow import StorageReads, StepStorages
from sublinear.profiling.compiled_nodes import InductorKinds, draws_random
from sublinear.profiling.compiled_realize import kernel_segments

# Bytes of results a horizontal fusion across a library kernel may make early (the compiled executor's fusion rule,
# which the profile follows): a BatchNorm backward's per-channel sums.
SMALL_RESULTS_MADE_EARLY = 4096


def reads_fused_into_reruns(joint: JointGraph, reads: StorageReads, storages: StepStorages, side: GradientSide,
                            op_of_node: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """Per forward value whose last backward reader inductor fuses into the re-run of a pointwise op reading it too:
    (that reader's rank, the op, the rank of the library call that first reads the op's value). The re-run is made
    right before that call, and the two kernels share a read; the compiled executor fuses them where the reader's
    backward inputs are made before the call and it makes no buffer there beyond one in place of an input of the
    same size it alone reads from there on. The fused kernel runs before the call, and the value is let go before
    the call allocates: a GELU's backward and the GELU re-run for the weight gradient of the linear after it."""
    fw, bw, ranks, kinds = joint.forward, joint.backward, reads.rank_of_backward, side.kinds
    segments = kernel_segments(bw, kinds)
    segment_of = {k: i for i, segment in enumerate(segments) for k in segment}
    readers = _backward_readers(bw, storages)
    first_read = _first_backward_reads(fw, storages, op_of_node, side)
    forward_readers: dict[int, list[int]] = defaultdict(list)  # forward value -> the ops reading it
    for i, node in enumerate(fw):
        for key in dict.fromkeys(key for arg in data_inputs(node) for key in storages.read_keys(node, arg)):
            forward_readers[key].append(op_of_node[i])
    pointwise = _pointwise_ops(fw, op_of_node, kinds)
    fused: dict[int, tuple[int, int, int]] = {}
    for key, last in reads.last_backward_read.items():
        group = [k for k in segments[segment_of[last]] if ranks[k] == ranks[last]]
        if not all(kinds.fusible(bw[k]) for k in group) or \
                _made_beyond_in_place(bw, group, storages, side) > SMALL_RESULTS_MADE_EARLY:
            continue
        made_before = max((side.born.get(value, -1) for k in group for arg in data_inputs(bw[k])
                           for value in storages.keys_of(arg) if side.born.get(value, -1) not in group), default=-1)
        producer = op_of_node[storages.produced_by[key]]
        for op in dict.fromkeys(forward_readers.get(key, ())):
            call = first_read.get(op)
            if op != producer and op in pointwise and call is not None and kinds.extern(bw[call]) and \
                    ranks[call] > ranks[last] and made_before < call < group[0] and \
                    not any(call < k < group[0] for k in readers[key]):
                fused[key] = (ranks[last], op, ranks[call])
                break
    return fused


def rerun_grad_sides(joint: JointGraph, reads: StorageReads, storages: StepStorages, side: GradientSide,
                     op_of_node: Sequence[int], walk: BackwardWalk) -> list[tuple[int, int]]:
    """Per op: the rank of the first backward node reading one of its values, and the gradient-side bytes as that
    node's kernel starts ((-1, 0): none reads one). The partitioned backward re-runs a value right before its first
    reader, after the kernels before it: a GELU re-run for the weight gradient of the linear after it is made beside
    that linear's input gradient, made from the output's gradient and the weight first."""
    first_read = _first_backward_reads(joint.forward, storages, op_of_node, side)
    return [(reads.rank_of_backward[first_read[o]], walk.entering[first_read[o]]) if o in first_read else (-1, 0)
            for o in range(max(op_of_node, default=-1) + 1)]


def _backward_readers(bw: list[fx.Node], storages: StepStorages) -> dict[int, list[int]]:
    """Per storage: the backward nodes reading it, in order."""
    readers: dict[int, list[int]] = defaultdict(list)
    for k, node in enumerate(bw):
        for key in dict.fromkeys(key for arg in data_inputs(node) for key in storages.read_keys(node, arg)):
            readers[key].append(k)
    return readers


def _first_backward_reads(fw: list[fx.Node], storages: StepStorages, op_of_node: Sequence[int],
                          side: GradientSide) -> dict[int, int]:
    """Per op: the first backward node reading one of its values (``side.first``)."""
    first: dict[int, int] = {}
    for i, node in enumerate(fw):
        for key in storages.keys_of(node):
            if key in side.first:
                first[op_of_node[i]] = min(first.get(op_of_node[i], side.first[key]), side.first[key])
    return first


def _pointwise_ops(fw: list[fx.Node], op_of_node: Sequence[int], kinds: InductorKinds) -> set[int]:
    """The ops of pointwise nodes drawing no random numbers: what a re-run computes in one fused kernel."""
    ops = set(op_of_node)
    for i, node in enumerate(fw):
        if not kinds.fusible(node) or draws_random(node):
            ops.discard(op_of_node[i])
    return ops


def _made_beyond_in_place(bw: list[fx.Node], group: list[int], storages: StepStorages, side: GradientSide) -> int:
    """The bytes of the buffers the backward nodes ``group`` make, but for one in place of each backward input of
    the same size that they read last (inductor writes such a result into the input's buffer)."""
    inside = set(group)
    dying = [side.sizes[key] for key in dict.fromkeys(key for k in group for arg in data_inputs(bw[k])
                                                       for key in storages.keys_of(arg))
             if side.born.get(key, -1) >= 0 and side.born[key] not in inside and side.last.get(key) in inside
             and side.buffer(key) and key not in side.outputs]
    made = 0
    for key in dict.fromkeys(key for k in group for key in storages.keys_of(bw[k])):
        if side.born.get(key) in inside and side.buffer(key):
            if side.sizes[key] in dying:
                dying.remove(side.sizes[key])
            else:
                made += side.sizes[key]
    return made
