"""The one reading of a plan (core.analysis.analyse) on hand-built profiles: which storages are kept, rebuilt or
transient, which ops each block's recompute re-runs, and where groups of soft blocks end."""

from __future__ import annotations

import dataclasses

import numpy as np

from sublinear.core import Plan, StorageState, analyse
from sublinear.core.analysis import keeping

from conftest import chain, hand_profile

RETAINED, REBUILT, TRANSIENT = StorageState.RETAINED, StorageState.REBUILT, StorageState.TRANSIENT


def test_flat_blocks_keep_their_boundaries_and_rebuild_the_inside():
    a = analyse(chain(6), Plan.of([2], 6))
    assert list(a.block_of) == [0, 0, 0, 1, 1, 1]
    # Storage 2 crosses into the next block: kept. 0 and 1 are saved inside block 0: rebuilt; the last block's own.
    assert list(a.state) == [REBUILT, REBUILT, RETAINED, RETAINED, RETAINED, RETAINED]
    assert a.closure == [[0, 1], []]  # block 0 re-runs what made its rebuilt storages, from the frame's inputs
    assert a.trigger[0] == 2 and a.trigger[1] == -1  # op 2's backward is the first to need a rebuilt storage


def test_soft_groups_rebuild_across_their_inner_boundary_from_the_groups_inputs():
    a = analyse(chain(6), Plan.of([1, 3], 6, soft=[1]))  # blocks [0,1] [2,3] [4,5]; the first two are one group
    assert list(a.group_of) == [0, 0, 1] and list(a.group_end) == [3, 3, 5]
    assert a.state[1] == REBUILT  # crosses the soft boundary: not retained
    assert a.state[3] == RETAINED  # crosses into the next group
    assert a.closure[1] == [0, 1, 2]  # reaches back into block 0 to rebuild what crossed the soft point
    assert a.frame_end[0] == a.frame_end[1]  # one frame for the group, released after its first rebuild


def test_a_view_read_by_a_later_block_keeps_its_base():
    # op 1 is a view of op 0's value (same storage); op 2, in the next block, reads the view.
    storages = [(0, 2, (2,))]
    profile = hand_profile(3, storages, {1: [(0, (0,))], 2: [(1, (0,))]}, outputs={1: (0,)})
    a = analyse(profile, Plan.of([1], 3))
    assert a.state[0] == RETAINED and a.closure == [[], []]
    kept_view = analyse(profile, Plan.of([0, 1], 3, kept=[1]))  # a kept op's value keeps the storage it views
    assert kept_view.state[0] == RETAINED


def test_a_saver_whose_values_never_reach_the_outputs_rebuilds_nothing():
    # op 1 saves storage 0 but its value reaches no output: autograd frees what it saved in forward.
    storages = [(0, 2, (1,)), (1, 1, ()), (2, 3, ())]
    profile = hand_profile(3, storages, {1: [(0, (0,))], 2: [(0, (0,))]}, reaching={0, 2})
    a = analyse(profile, Plan.of([0, 1], 3))
    assert a.state[0] == RETAINED  # read by a later block
    dead = analyse(hand_profile(3, [(0, 1, (1,)), (1, 1, ()), (2, 3, ())], {1: [(0, (0,))]}, reaching={0, 2}),
                   Plan.of([1], 3))
    assert dead.state[0] == TRANSIENT and dead.closure == [[], []]


def test_pinned_and_kept_ops_are_never_recomputed():
    a = analyse(hand_profile(4, [(0, 1, (1,)), (1, 2, (2,)), (2, 3, (3,)), (3, 4, ())],
                             {1: [(0, (0,))], 2: [(1, (1,))], 3: [(2, (2,))]}, pinned={1}),
                Plan.of([2], 4, kept=[0]))
    assert list(a.recomputed) == [False, False, True, False]
    assert a.state[0] == RETAINED and a.state[1] == RETAINED  # made by ops that are never re-run
    assert a.closure[0] == []  # storage 2 crosses into block 1: nothing of block 0 is rebuilt


def test_a_shared_recompute_reads_a_kept_value_saved_unless_it_is_part_of_a_tuple():
    """Op 1 (a layer norm: a statistic for its own backward, an output the next block reads) is re-run for its own
    backward at rank 1; op 2's re-run at rank 3 reads op 1's output, which the plan keeps, so forward saves it and
    op 1 is not re-run before rank 3. Where the output is part of a tuple with the dropped statistic (a max-pool's
    values beside its indices) the partitioner recomputes the whole tuple, so op 1 re-runs before op 2."""
    storages = [(0, 1, (1,)), (1, 1, (1,)), (1, 2, (2,)), (2, 3, (3,)), (3, 4, (4,)), (4, 5, (5,)), (5, 6, ())]
    reads = {1: [(0, (0,))], 2: [(1, (2,))], 3: [(2, (3,))], 4: [(3, (4,))], 5: [(4, (5,))]}
    plan = Plan.of([1, 3, 5], 6)

    def ranks(profile):
        a = analyse(dataclasses.replace(profile, recompute_shared=True), plan)
        assert a.state[2] == RETAINED and a.closure == [[0, 1], [2], []]
        return dict(zip(a.recompute_pairs[1].tolist(), a.recompute_ranks.tolist()))

    assert ranks(hand_profile(6, storages, reads, outputs={1: (2,)})) == {0: 1, 1: 1, 2: 3}
    assert ranks(hand_profile(6, storages, reads, outputs={1: (1, 2)})) == {0: 3, 1: 3, 2: 3}


def test_keeping_retains_what_the_plan_retained_on_another_profile_of_the_graph_and_nothing_more():
    # Storage 1 returned and held by the caller on one profile (retained: the code partitioned there saves it), let
    # go when forward returns on the other (rebuilt there by the same plan): keeping op 1 describes that code.
    storages = [(i, i + 1 if i + 1 < 6 else 6, (i + 1,) if i + 1 < 6 else ()) for i in range(6)]
    held = hand_profile(6, [(0, 1, (1,)), (1, 6, (2,)), *storages[2:]], {i + 1: [(i, (i,))] for i in range(5)})
    dropped, plan = chain(6), Plan.of([2], 6)
    assert analyse(held, plan).state[1] == RETAINED and analyse(dropped, plan).state[1] == REBUILT
    kept = keeping(dropped, plan, analyse(held, plan).retained)
    assert kept == Plan.of([2], 6, kept=[1])
    assert list(analyse(dropped, kept).state) == list(analyse(held, plan).state)
    assert keeping(dropped, plan, analyse(dropped, plan).retained) is plan


def test_a_fused_value_its_re_run_op_makes_again_is_not_kept_for_a_later_blocks_forward_read():
    """Op 1 makes the scaled queries (storage 1, saved by op 2) and an additive mask (storage 2, no buffer in
    forward, saved by none) that op 2 of its block and op 4 of the last block read. A compiled step re-runs op 1 for
    the queries anyway, which makes the mask again for op 2's re-run: the mask is neither kept nor saved. Where op
    1 would be re-run for the mask alone, or the mask is a buffer in forward, or recomputes are not shared (the
    eager executor), it is kept."""
    storages = [(0, 1, (1,)), (1, 2, (2,)), (1, 4, ()), (2, 3, (3,)), (3, 4, (4,)), (4, 5, (5,)), (5, 6, ())]
    reads = {1: [(0, (0,))], 2: [(1, (1,)), (1, (2,))], 3: [(2, (3,))], 4: [(3, (4,)), (1, (2,))], 5: [(4, (5,))]}
    fused_mask = [True, True, False, True, True, True, True]
    plan = Plan.of([3], 6)

    def analysed(storages=storages, in_forward=fused_mask, shared=True, reads=reads):
        profile = dataclasses.replace(hand_profile(6, storages, reads), recompute_shared=shared,
                                      materialized_in_forward=np.array(in_forward, dtype=bool))
        return analyse(profile, plan)

    a = analysed()
    assert a.state[2] == TRANSIENT and a.made_again[2] and a.state[1] == REBUILT
    assert a.closure[0] == [0, 1, 2]
    assert analysed(shared=False).state[2] == RETAINED
    assert analysed(in_forward=[True] * 7).state[2] == RETAINED
    mask_alone = analysed([(0, 1, (1,)), (1, 1, ()), *storages[2:]], reads={**reads, 2: [(1, (2,))]})
    assert mask_alone.state[2] == RETAINED and mask_alone.closure[0] == [0, 2]
