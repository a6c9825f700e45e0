import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sublinear
from sublinear.capture.dynamo import capture
from sublinear.models import get_model
from sublinear.profiling.eager_trace import ProfileError
from sublinear.profiling.graph import profile
from sublinear.training import training_step

from conftest import ResidualNet, profile_of

_profile = profile_of


def test_in_place_writes_stay_in_the_producing_op():
    p = _profile(ResidualNet(), torch.randn(2, 3, 8, 8))
    names = [op.name for op in p.ops]
    # BatchNorm followed by ReLU(inplace=True) is one op; so are BatchNorm, the in-place residual add (out += x) on
    # its output and the in-place ReLU after it.
    assert any("b1 (batch_norm" in n and n.endswith("+1") for n in names)
    assert sum("b2 (out" in n and n.endswith("+2") for n in names) == 3
    for op in p.ops:
        assert list(op.nodes) == list(range(op.nodes[0], op.nodes[-1] + 1)) or len(op.nodes) == 1


def test_flags():
    p = _profile(ResidualNet(), torch.randn(2, 3, 8, 8))
    by_name = {op.name: op for op in p.ops}
    assert by_name["drop (dropout)"].random
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


class ViewsAndInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x):
        h = self.lin(x)  # the only large storage: 4 x 32 floats
        a, b = h[:, :16], h[:, 16:]  # views of h
        a.mul_(2)  # writes h's storage in place
        v = b.view(-1, 4, 4).transpose(1, 2)  # views of h
        return v.sum((1, 2)) + a.sum(-1)


def test_views_and_in_place_results_alias_their_base_storage():
    p = _profile(ViewsAndInPlace(), torch.randn(4, 16))
    large = [int(b) for b in p.storage_bytes if b >= 4 * 32 * 4]
    assert large == [4 * 32 * 4]  # h once: chunks, views and the in-place result made no storage of their own
    linear = next(op for op in p.ops if op.name.startswith("lin (h)"))
    assert p.storage_producer[np.flatnonzero(p.storage_bytes == 4 * 32 * 4)[0]] == linear.index
    assert len(linear.nodes) >= 3  # linear, the slice and mul_ form one op: h is never written after its op


@pytest.mark.slow
def test_forward_flops_match_flop_counter():
    spec = get_model("tiny-resnet")
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(2)
    p = profile_of(model, *args)
    with FlopCounterMode(display=False) as counter:
        model(*args)
    assert p.forward_flops == counter.get_total_flops() > 0


@pytest.mark.parametrize("name", ["tiny-resnet", "tiny-bert", "tiny-gpt"])
@pytest.mark.slow
def test_profiled_eager_peak_equals_measured_step(name):
    spec = get_model(name)
    torch.manual_seed(0)
    model = spec.build().train()
    args, _ = spec.example_inputs(3)
    p = profile(capture(model, args).graph, cost_model="estimate")

    measured = sublinear.measure(training_step, model, *args)
    assert abs(p.measured_peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.01
    assert p.parameter_bytes == measured.parameter_bytes


@pytest.mark.parametrize("values", ["fake (captured)", "real"])
@pytest.mark.slow
def test_profile_does_not_touch_the_users_module(values):
    model = ResidualNet()
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = capture(model, (x,)).graph
    if values == "real":  # the graph's inputs as a real call passes them: the module's own tensors
        named = dict(model.named_parameters()) | dict(model.named_buffers())
        real = [x if source.startswith("L['args']") else named[_dotted(source)] for source in graph.sources]
        profile(graph, real, cost_model="measure")
    else:
        profile(graph, cost_model="measure")
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    assert all(p.grad is None for p in model.parameters())


def _dotted(source: str) -> str:
    """L['self']._modules['blocks']._modules['0']._parameters['weight'] -> blocks.0.weight"""
    import re

    return ".".join(re.findall(r"\['([^']+)'\]", source)[1:])


def test_measured_costs_time_every_node_and_see_kernel_workspace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3))
    x = torch.randn(8, 3, 32, 32)
    graph = capture(model.train(), (x,)).graph
    measured = profile(graph, cost_model="measure")
    estimated = profile(graph, cost_model="estimate")
    assert measured.cost_source == "measured on cpu" and estimated.cost_source.startswith("estimated")
    assert all(op.forward_seconds > 0 for op in measured.ops)
    assert all(op.forward_seconds > 0 for op in estimated.ops)  # elementwise ops are never free
    assert (measured.backward_seconds > 0).sum() >= 3
    # The allocator sees at least what storage tracking sees, per op and per backward node.
    assert all(m.forward_extra_bytes >= e.forward_extra_bytes for m, e in zip(measured.ops, estimated.ops))
    assert (measured.grad_peak >= estimated.grad_peak).all()


def test_device_constants_to_device_and_tensors_created_in_forward():
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device)[None, :, None].float()
            bias = torch.tensor([0.5]).to(x.device)
            return self.lin(x + pos) + bias

    x = torch.randn(2, 5, 8)
    p = profile_of(Positions(), x)
    assert p.num_ops > 3
    meta = profile_of(Positions().to("meta"), x.to("meta"))
    assert meta.num_ops == p.num_ops


def test_a_failing_node_is_named_with_its_module_and_line():
    from torch import fx

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = Broken()
    graph = capture(model, (torch.randn(2, 4),)).graph
    with pytest.raises(ProfileError, match=r"lin \(linear\) at .*test_profiler.py:\d+ failed on fake tensors"):
        profile(graph, [torch.randn(2, 4) if v.dim() == 2 and v.shape[0] == 2 else torch.randn(3, 3)
                        for v in graph.example_values], cost_model="estimate")
    assert isinstance(graph.graph_module, fx.GraphModule)


@pytest.mark.parametrize("version, setting, own_lt", [("2.13.0+cpu", None, False), ("2.11.0+cu130", None, True),
                                                     ("2.13.0+cpu", "0", True), ("2.11.0+cu130", "1", False)])
def test_cuda_steps_hold_one_cublas_workspace_per_thread_running_matrix_products(monkeypatch, version, setting,
                                                                                 own_lt):
    """The caller's thread (forward) and autograd's device thread (backward): two handles, a workspace each, and a
    cuBLASLt workspace each where a product with a bias runs and cuBLASLt's is not the cuBLAS one (torch 2.11's
    default, measured on an H200: an addmm left 1 MiB more allocated than a plain product)."""
    from sublinear.profiling.kernels import blas_workspace_bytes

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cublas_workspace_size", lambda: 32 << 20, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "cublaslt_workspace_size", lambda: 1 << 20, raising=False)
    if setting is None:
        monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", setting)
    assert blas_workspace_bytes("cuda") == (66 << 20 if own_lt else 64 << 20)
    assert blas_workspace_bytes("cuda", cublaslt=False) == 64 << 20
    assert blas_workspace_bytes("cpu") == blas_workspace_bytes("meta") == 0


@pytest.mark.parametrize("bias", [True, False])
def test_both_front_ends_know_whether_a_step_runs_a_product_with_a_bias(monkeypatch, bias):
    """An addmm (a linear layer with a bias) takes cuBLASLt, whose workspace may be one of its own."""
    from sublinear.capture.joint import trace_joint
    from sublinear.profiling import compiled as compiled_front_end
    from sublinear.profiling import graph as eager_front_end
    from sublinear.profiling.compiled import profile_joint

    seen = []
    monkeypatch.setattr(eager_front_end, "blas_workspace_bytes", lambda device, cublaslt: seen.append(cublaslt) or 0)
    monkeypatch.setattr(compiled_front_end, "blas_workspace_bytes", lambda device, cublaslt: seen.append(cublaslt) or 0)
    model, x = nn.Sequential(nn.Linear(8, 16, bias=bias), nn.ReLU(), nn.Linear(16, 2, bias=bias)), torch.randn(4, 8)
    profile_of(model, x)
    graph = capture(model, (x,)).graph
    profile_joint(trace_joint(graph, graph.example_values), graph, None, measure_scratch=False)
    assert seen == [bias, bias]


@pytest.mark.parametrize("capability, config, expected", [((9, 0), None, 32 << 20), ((8, 0), None, 8320 << 10),
                                                          ((9, 0), ":16:8", 128 << 10)])
def test_without_a_workspace_query_the_cublas_workspace_is_read_from_its_config(monkeypatch, capability, config,
                                                                                 expected):
    """torch 2.11 has no ``cublas_workspace_size``: the size comes from ``CUBLAS_WORKSPACE_CONFIG`` or its default."""
    from sublinear.profiling.kernels import blas_workspace_bytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if hasattr(torch.backends.cuda, "cublas_workspace_size"):
        monkeypatch.delattr(torch.backends.cuda, "cublas_workspace_size")
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    assert blas_workspace_bytes("cuda") == 2 * expected


def test_the_libraries_workspaces_are_in_the_baseline_every_plan_and_the_floor_hold(monkeypatch):
    from sublinear.core import Plan
    from sublinear.planners.driver import step_floor
    from sublinear.profiling import graph as eager_front_end
    from sublinear.simulation.timeline import simulate

    model, x = ResidualNet().train(), torch.randn(2, 3, 8, 8)
    plain = profile_of(model, x)
    monkeypatch.setattr(eager_front_end, "blas_workspace_bytes", lambda device, cublaslt: 1 << 20)
    held = profile_of(model, x)
    assert held.workspace_bytes == 1 << 20 and held.baseline_bytes == plain.baseline_bytes + (1 << 20)
    for plan in (Plan.no_split(plain.num_ops), Plan.of(range(1, plain.num_ops, 2), plain.num_ops)):
        assert simulate(held, plan).peak_bytes == simulate(plain, plan).peak_bytes + (1 << 20)
    assert ("cuBLAS workspaces", 1 << 20) in step_floor(held).parts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_cuda_step_measures_its_prediction_cublas_workspaces_included(compiler):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)])
    model, x = model.cuda().train(), torch.randn(512, 256, device="cuda")
    compiled = sublinear.compile(model, (x,), config=sublinear.SublinearMemoryConfig(compiler=compiler,
                                                                                      cache_dir=""))

    def step(m, x):
        m(x).square().mean().backward()

    step(compiled, x)  # both threads' workspaces made, the plan compiled
    model.zero_grad(set_to_none=True)
    measured = sublinear.measure(step, compiled, x).peak_bytes
    assert measured == pytest.approx(compiled.sublinear_plan.predicted_peak_bytes, rel=0.01, abs=1 << 20)
