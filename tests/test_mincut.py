import copy
import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn

import sublinear
from sublinear.capture.dynamo import capture
from sublinear.capture.joint import JointGraph, labelled_copy, normalise, trace_joint
from sublinear.core import Plan
from sublinear.core.analysis import analyse
from sublinear.measurement import measure_cpu_allocator
from sublinear.planners import make_plan
from sublinear.planners.mincut import CutNetwork, MinCutPlanner, banned_at, levels
from sublinear.profiling.compiled import profile_joint
from sublinear.simulation.timeline import simulate
from sublinear.training import training_step

from conftest import PLAIN, assert_same_training, hand_profile, problem_for, train_steps

# One worker runs every test of the ResNet-50 profile, so the session makes it once.
pytestmark = pytest.mark.xdist_group("meta_resnet50")


def _profile(num_ops, reads, saved, sizes):
    """One storage per op (``sizes[o]`` bytes); op ``o`` reads the storages of ``reads[o]``; storage ``o`` is saved for
    backward by the ops ``saved[o]``."""
    readers = {o: [r for r in range(num_ops) if o in reads.get(r, ())] for o in range(num_ops)}
    storages = [(o, num_ops if o == num_ops - 1 else max(readers[o], default=o), tuple(saved.get(o, ())))
                for o in range(num_ops)]
    profile = hand_profile(num_ops, storages, {r: [(p, (p,)) for p in ps] for r, ps in reads.items()})
    return dataclasses.replace(profile, storage_bytes=np.array(sizes, dtype=np.int64))


def _rebuildable(profile, banned, kept_storages):
    """Whether backward can rebuild every storage it reads from ``kept_storages`` with unbanned ops."""
    kept = set(int(s) for s in kept_storages)
    available = []
    for s in range(len(profile.storage_bytes)):  # a storage's producer reads only earlier storages
        op = int(profile.storage_producer[s])
        available.append(s in kept or (not banned[op] and all(available[t] for _, t in
                                                                   profile.arrays.inputs_by_reader[op])))
    return all(available[s] for s, savers in enumerate(profile.storage_saved_by) if savers)


def _banned(num_ops, ops):
    banned = np.zeros(num_ops, dtype=bool)
    banned[list(ops)] = True
    return banned


@pytest.mark.parametrize("sizes, kept", [((100, 400, 400, 100, 100), [0]), ((1000, 400, 400, 100, 100), [1])])
def test_the_cut_keeps_the_fewest_bytes_from_which_a_cheap_chain_is_rebuilt(sizes, kept):
    # A matrix product (op 0), two pointwise ops (1, 2) whose values backward reads, a matrix product reading the
    # second (3), and the loss (4). Backward reads 1 and 2: keeping 0 rebuilds both, keeping 1 rebuilds 2.
    profile = _profile(5, {1: [0], 2: [1], 3: [2], 4: [3]}, {1: (2,), 2: (3,)}, sizes)
    banned = _banned(5, [0, 3, 4])
    network = CutNetwork(profile)
    assert network.storages(banned).tolist() == kept
    plan = Plan.of([3], 5, network.kept(banned))
    rerun = set(itertools.chain.from_iterable(analyse(profile, plan).closure))
    assert rerun == {1, 2} - set(kept) and not rerun & {0, 3}


@pytest.mark.parametrize("seed", range(40))
def test_the_cut_is_the_least_bytes_any_set_of_kept_storages_can_rebuild_backward_from(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    reads = {o: sorted(rng.sample(range(o), k=rng.randint(0, min(o, 2)))) for o in range(1, n)}
    readers = {o: [r for r, ps in reads.items() if o in ps] for o in range(n)}
    saved = {o: (rng.choice(readers[o] or [o]),) for o in range(n) if rng.random() < 0.6}
    profile = _profile(n, reads, saved, [rng.choice([100, 200, 400, 800, 1600]) for _ in range(n)])
    banned = np.array([rng.random() < 0.3 for _ in range(n)], dtype=bool)
    cut = CutNetwork(profile).storages(banned)
    assert _rebuildable(profile, banned, cut)
    least = min(int(profile.storage_bytes[list(k)].sum()) for size in range(n + 1)
                for k in itertools.combinations(range(n), size) if _rebuildable(profile, banned, k))
    assert int(profile.storage_bytes[cut].sum()) == least


@pytest.mark.slow
def test_at_every_level_a_recompute_reruns_no_banned_op(meta_resnet50):
    profile = meta_resnet50[2]
    found = levels(profile)
    assert found == sorted(found) and found[-1] == float("inf") and 2 <= len(found) <= 17
    network = CutNetwork(profile)
    for level in found:
        banned = banned_at(profile, level)
        plan = Plan.of([profile.num_ops - 2], profile.num_ops, network.kept(banned))
        rerun = set(itertools.chain.from_iterable(analyse(profile, plan).closure))
        assert not rerun & set(np.flatnonzero(banned).tolist())
    proposed = MinCutPlanner().propose(problem_for(profile), [])
    assert len(proposed) >= 2 and all(c.simulation == simulate(profile, c.plan) for c in proposed)


class _Choice(CustomPartitionerFn):
    """Inductor's min-cut partitioner at an activation memory budget: records the forward nodes its backward
    recomputes, then stops the compile."""

    def __init__(self, budget):
        self.budget, self.recomputed = budget, None

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        forward = [n.name for n in JointGraph.of(normalise(gm), kwargs["num_fwd_outputs"]).forward]
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            _, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        rerun = {n.name for n in backward.graph.nodes if n.op == "call_function"}
        self.recomputed = [name for name in forward if name in rerun]
        raise InterruptedError

    def uuid(self):
        return None


@pytest.mark.slow
def test_at_the_partitioners_memory_the_plan_recomputes_no_longer_than_the_partitioners_choice():
    from torch._inductor.compile_fx import compile_fx
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=128)).train()
    ids = torch.randint(0, 512, (4, 128))
    graph = capture(model, (ids,), {"labels": ids}).graph
    compiled = profile_joint(trace_joint(graph, graph.example_values), graph, None)
    profile, index = compiled.profile, {name: i for i, name in enumerate(compiled.node_names)}
    n = profile.num_ops
    for budget in (0.5, 0.8):
        choice = _Choice(budget)
        with pytest.raises(InterruptedError):
            compile_fx(labelled_copy(graph.graph_module), list(graph.example_values),
                       config_patches={"custom_partitioner_fn": choice})
        rerun = {int(profile.op_of_node[index[name]]) for name in choice.recomputed}
        theirs = simulate(profile, Plan.of([n - 2], n, set(range(n)) - rerun))
        config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="inductor")
        ours = make_plan(profile, config, memory_budget=theirs.peak_bytes).simulation
        assert ours.peak_bytes <= theirs.peak_bytes
        assert ours.recompute_seconds <= theirs.recompute_seconds


def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel(config).train(), torch.randint(0, 256, (4, 64))


def _min_cut_plan(profile):
    """The min cut at the lowest level: every op with FLOPs kept, the cheap ops between them recomputed."""
    n = profile.num_ops
    return Plan.of([n - 2], n, CutNetwork(profile).kept(banned_at(profile, levels(profile)[0])))


def _planned(model, ids, compiler, plan_for):
    """``model`` compiled on ``compiler`` to run ``plan_for(profile)``; with that profile and plan."""
    compiled = sublinear.compile(model, (ids,), {"labels": ids}, config=dataclasses.replace(PLAIN, compiler=compiler))
    profile = compiled.sublinear_profile
    plan = plan_for(profile)
    compiled.use(plan)
    return compiled, profile, plan


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_min_cut_plan_trains_as_eager_and_measures_its_prediction(compiler):
    # The eager executor replays dropout's masks and runs eager's kernels: bit for bit as eager, dropout on. Inductor
    # draws its own random numbers and fuses differently from eager, so its reference is its own step without
    # recompute, without dropout, to fp32 rounding.
    model, ids = _gpt2(0.1 if compiler == "eager" else 0.0)
    if compiler == "eager":
        reference = train_steps(copy.deepcopy(model), (ids,), {"labels": ids})
    else:
        unplanned, _, _ = _planned(copy.deepcopy(model), ids, compiler, lambda p: Plan.no_split(p.num_ops))
        reference = train_steps(unplanned, (ids,), {"labels": ids}, steps=1)
    compiled, profile, plan = _planned(model, ids, compiler, _min_cut_plan)
    assert analyse(profile, plan).recompute_pairs[1].size  # it recomputes
    trained = train_steps(compiled, (ids,), {"labels": ids}, steps=1 if compiler == "inductor" else 2)
    if compiler == "eager":
        assert_same_training(reference, trained)
    else:
        torch.testing.assert_close(trained[:3], reference[:3], rtol=2e-5, atol=1e-5)
    training_step(compiled, ids, labels=ids)  # the step measured: its outputs held while backward runs
    model.zero_grad(set_to_none=True)
    measured = measure_cpu_allocator(training_step, compiled, ids, labels=ids).peak_bytes
    report = compiled.sublinear_plan.graphs[0]
    if compiler == "eager":
        assert abs(measured - report.predicted_peak_bytes) <= max(0.02 * measured, 256 * 1024)
    else:
        # On the safe side before compiling (11 % over on this model: the recomputed GELU chain is counted as
        # buffers that its backward kernel fuses); as compiled, what the allocator counts.
        assert measured <= report.predicted_before_compile_bytes, (measured, report.predicted_before_compile_bytes)
        assert abs(measured - report.compiled_peak_bytes) <= 0.005 * measured, (measured, report.compiled_peak_bytes)
