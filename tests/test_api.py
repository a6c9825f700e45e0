"""compile() and the @sublinear.trace decorator."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sublinear
from sublinear.models import get_model

from conftest import ResidualNet


def _eager_losses(model, batches, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    losses = []
    for data, label in batches[:steps]:
        loss = F.cross_entropy(model(data), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _batches(n, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def test_decorator_trains_exactly_like_eager_and_leaves_the_module_alone():
    spec = get_model("tiny-resnet")
    torch.manual_seed(0)
    base = spec.build().train()
    batches = _batches(3)
    expected = _eager_losses(copy.deepcopy(base), batches, 3)

    net = copy.deepcopy(base)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    @sublinear.trace(sublinear_memory_config=sublinear.SublinearMemoryConfig())
    def train_func(data, label, *, net, optimizer):
        loss = F.cross_entropy(net(data), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    torch.manual_seed(0)
    losses = [train_func(d, l, net=net, optimizer=optimizer).detach() for d, l in batches]
    assert all(torch.equal(a, b) for a, b in zip(expected, losses))
    assert type(net) is type(base) and not hasattr(net, "sublinear_plan")
    compiled = train_func.sublinear_modules[net]
    assert compiled.sublinear_plan.num_blocks > 1
    assert list(compiled.state_dict()) == list(net.state_dict())


def test_bare_form_and_call_form_and_pass_through():
    calls = []

    @sublinear.trace
    def f(x, scale, model):
        calls.append(type(model).__name__)
        if scale < 0:
            raise ValueError("negative scale")
        return model(x).sum() * scale, "extra"

    lin = nn.Linear(4, 4)
    out, extra = f(torch.randn(2, 4), 2.0, lin)
    assert extra == "extra" and calls == ["SublinearModule"]
    with pytest.raises(ValueError, match="negative scale"):
        f(torch.randn(2, 4), -1.0, lin)
    g = sublinear.trace(lambda m, x: m(x), sublinear_memory_config=sublinear.SublinearMemoryConfig(seed=3))
    assert g(lin, torch.randn(2, 4)).shape == (2, 4)


def test_replans_when_the_signature_changes(caplog):
    model = ResidualNet()

    @sublinear.trace
    def step(model, x):
        model(x).sum().backward()

    step(model, torch.randn(2, 3, 8, 8))
    compiled = step.sublinear_modules[model]
    first = compiled.sublinear_plan
    step(model, torch.randn(2, 3, 8, 8))
    assert compiled.sublinear_plan is first  # same signature: no new plan
    step(model, torch.randn(6, 3, 8, 8))
    assert compiled.sublinear_plan is not first
    assert len(compiled._variants) == 2


def test_compile_accepts_other_batch_sizes_without_replanning():
    model = ResidualNet()
    compiled = sublinear.compile(model, torch.randn(2, 3, 8, 8))
    plan = compiled.sublinear_plan
    compiled(torch.randn(5, 3, 8, 8)).sum().backward()
    assert compiled.sublinear_plan is plan


def test_module_changed_after_compile_is_detected_and_planned_again(caplog):
    model = ResidualNet()
    compiled = sublinear.compile(model, torch.randn(2, 3, 8, 8))
    plan = compiled.sublinear_plan
    model.fc = nn.Linear(8, 7)  # the old graph would still call the old fc
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        out = compiled(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 7)
    assert compiled.sublinear_plan is not plan
    assert "changed since it was planned" in caplog.text


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_decorator_inside_ddp_keeps_ddp_and_its_hooks(single_process_group):
    torch.manual_seed(0)
    base = ResidualNet()
    reference = copy.deepcopy(base)
    net = nn.parallel.DistributedDataParallel(base)
    x = torch.randn(4, 3, 8, 8)

    @sublinear.trace
    def step(net, x):
        net(x).sum().backward()

    torch.manual_seed(1)
    step(net, x)
    assert isinstance(net.module, ResidualNet)  # restored after the call
    torch.manual_seed(1)
    reference(x).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), base.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_no_trainable_parameters():
    model = ResidualNet()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled = sublinear.compile(model, x)
    torch.manual_seed(0)
    compiled(x).sum().backward()
    reference_x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    model(reference_x).sum().backward()
    assert torch.equal(x.grad, reference_x.grad)
    out = compiled(torch.randn(2, 3, 8, 8))  # nothing requires grad: plain forward
    assert out.grad_fn is None


def test_other_dtype_and_device_work():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    compiled = sublinear.compile(model, torch.empty(4, 8, device="meta"))
    model.double()
    x = torch.randn(5, 8, dtype=torch.float64)
    compiled(x).sum().backward()
    model_grad = model[0].weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    assert model_grad.dtype == torch.float64 and torch.equal(model_grad, model[0].weight.grad)


def test_bad_config_and_arguments():
    with pytest.raises(TypeError, match="SublinearMemoryConfig"):
        sublinear.compile(nn.Linear(2, 2), torch.randn(1, 2), config={"thresh_nr_try": 3})
    with pytest.raises(TypeError, match="nn.Module"):
        sublinear.compile(lambda x: x, torch.randn(1, 2))
    with pytest.raises(TypeError, match="decorates a function"):
        sublinear.trace(3)
    with pytest.raises(TypeError, match="compile the plain module"):
        sublinear.compile(sublinear.compile(nn.Linear(2, 2), torch.randn(1, 2)), torch.randn(1, 2))
