import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sublinear
from sublinear.tracer import capture
from sublinear.models import get_model
from sublinear.profiler import meta_twin, profile, training_step

from conftest import Branchy, ResidualNet


def _profile(module, *args, **kwargs):
    return profile(capture(module.train(), args, kwargs), args, kwargs)


def test_in_place_writes_stay_in_the_producing_op():
    p = _profile(ResidualNet(), torch.randn(2, 3, 8, 8))
    names = [op.name for op in p.ops]
    # BatchNorm followed by ReLU(inplace=True) is one op; so is the residual add followed by the in-place ReLU.
    assert any("b1" in n and n.endswith("+1") for n in names)
    assert any(n.startswith("add") and n.endswith("+1") for n in names)
    for op in p.ops:
        assert list(op.nodes) == list(range(op.nodes[0], op.nodes[-1] + 1)) or len(op.nodes) == 1


def test_flags():
    p = _profile(ResidualNet(), torch.randn(2, 3, 8, 8))
    by_name = {op.name: op for op in p.ops}
    assert by_name["drop (drop)"].random
    bn_ops = [op for op in p.ops if "b2" in op.name]
    assert bn_ops and all(op.mutates_state and op.snapshot_bytes > 0 for op in bn_ops)
    assert not any(op.pinned for op in p.ops)
    assert sum(op.random for op in p.ops) == 1


def test_state_written_through_something_else_pins_the_reader():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(4))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x) + self.seen  # reads the buffer that the next line writes
            self.seen.add_(x.detach().sum(0))
            return y

    p = _profile(Counter(), torch.randn(3, 4))
    assert any(op.pinned and "reads state" in op.pin_reason for op in p.ops)


def test_saved_storages_are_deduplicated_and_views_alias():
    x = torch.randn(4, 16)
    p = _profile(Branchy(), x, torch.randn(4, 16), scale=2.0)
    # One storage per allocation: no storage appears twice, and chunk/view outputs created no storage.
    assert len(set(range(len(p.storage_bytes)))) == len(p.storage_bytes)
    chunk_op = next(op for op in p.ops if "chunk" in op.name)
    assert not any(p.storage_producer == chunk_op.index)


def test_forward_flops_match_flop_counter():
    spec = get_model("tiny-resnet")
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(2)
    p = profile(capture(model, args), args)
    twin, = meta_twin(model)
    with FlopCounterMode(display=False) as counter:
        twin(*[a.to("meta") for a in args])
    assert p.forward_flops == counter.get_total_flops() > 0


@pytest.mark.parametrize("name", ["tiny-resnet", "tiny-bert", "tiny-gpt"])
def test_profiled_eager_peak_equals_measured_step(name):
    spec = get_model(name)
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(3)
    p = profile(capture(model, args), args)

    measured = sublinear.measure(training_step, model, *args)
    assert abs(p.measured_peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.01
    assert p.parameter_bytes == measured.parameter_bytes


def test_profile_does_not_touch_the_users_module():
    model = ResidualNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _profile(model, torch.randn(2, 3, 8, 8))
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    assert all(p.grad is None for p in model.parameters())
