import pytest
import torch

from sublinear.costs import REFERENCE_GPU, StepCost, aten_work, estimate_seconds

aten = torch.ops.aten


def _work(func, *args, **kwargs):
    out = func(*args, **kwargs)
    return aten_work(func, args, kwargs, out)


@pytest.mark.parametrize("call", [
    lambda x: (aten.view.default, x, [8, 32]),
    lambda x: (aten.t.default, x),
    lambda x: (aten.transpose.int, x, 0, 1),
    lambda x: (aten.expand.default, x[:1], [64, 4]),
    lambda x: (aten.permute.default, x, [1, 0]),
    lambda x: (aten.detach.default, x),
    lambda x: (aten._unsafe_view.default, x, [256]),
    lambda x: (aten.empty_like.default, x),
])
def test_views_aliases_and_bare_allocations_move_no_bytes(call):
    func, *args = call(torch.randn(64, 4))
    assert _work(func, *args) == (0, 0)


def test_elementwise_ops_read_their_inputs_and_write_their_result():
    x, y = torch.randn(64, 4), torch.randn(64, 4)
    assert _work(aten.add.Tensor, x, y) == (0, 3 * x.nbytes)
    assert _work(aten.relu.default, x) == (0, 2 * x.nbytes)
    assert _work(aten.zeros_like.default, x) == (0, x.nbytes)  # reads only x's shape


def test_a_broadcast_input_is_read_over_its_storage_not_its_expanded_size():
    scores = torch.randn(2, 12, 128, 128)
    mask = torch.randn(2, 1, 1, 128)
    _, moved = _work(aten.add.Tensor, scores, mask.expand_as(scores))
    assert moved == 2 * scores.nbytes + mask.nbytes
    transposed = scores.transpose(-1, -2)  # a permutation spans every element once
    assert _work(aten.clone.default, transposed) == (0, 2 * scores.nbytes)


def test_matmul_flops_follow_the_flop_counter():
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    flops, moved = _work(aten.mm.default, a, b)
    assert flops == 2 * 32 * 64 * 16
    assert moved == a.nbytes + b.nbytes + 32 * 16 * 4


def test_step_cost_charges_views_their_call_overhead_only():
    x = torch.randn(64, 32, device="meta")
    with StepCost(REFERENCE_GPU) as cost:
        x.view(32, 64).t().relu()
    assert cost.flops == 0
    assert cost.seconds == pytest.approx(estimate_seconds(0, 2 * x.nbytes, 3, REFERENCE_GPU))
