import pytest
import torch

from sublinear.profiling.costs import REFERENCE_GPU, StepCost, aten_work, estimate_seconds

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


_PLAN_IN_A_FRESH_PROCESS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import sublinear
from conftest import ResidualNet
torch.manual_seed(0)
config = sublinear.SublinearMemoryConfig(cache_dir="", compiler="eager")  # the default cost model; no plan cache
compiled = sublinear.compile(ResidualNet(width=16), (torch.randn(8, 3, 32, 32),), config=config)
print(json.dumps([g.plan.as_dict() for g in compiled.sublinear_plan.graphs] +
                 [compiled.sublinear_plan.predicted_peak_bytes]))
"""


@pytest.mark.slow
def test_the_default_cost_model_gives_the_same_plan_in_fresh_processes(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = _PLAN_IN_A_FRESH_PROCESS.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "SUBLINEAR_CACHE_DIR": str(tmp_path)}  # where the device's rates are kept
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(3)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    plans = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    assert plans[0] == plans[1] == plans[2]
    assert (tmp_path / "device-rates.json").exists()


def test_device_rates_are_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    import json

    from sublinear.profiling.costs import device_rates

    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path))
    device_rates.cache_clear()
    try:
        measured = device_rates("cpu")
        stored = json.loads((tmp_path / "device-rates.json").read_text())
        (key, values), = stored.items()
        assert values == [measured.flops_per_second, measured.bytes_per_second, measured.seconds_per_call,
                          measured.half_flops_per_second]
        (tmp_path / "device-rates.json").write_text(json.dumps({key: [1e12, 2e11, 3e-6, 4e12]}))
        device_rates.cache_clear()  # a new process: reads what the first one measured
        again = device_rates("cpu")
        assert (again.flops_per_second, again.bytes_per_second, again.seconds_per_call,
                again.half_flops_per_second) == (1e12, 2e11, 3e-6, 4e12)
        assert (again.matmul_flops_per_second(2), again.matmul_flops_per_second(4)) == (4e12, 1e12)
        (tmp_path / "device-rates.json").write_text(json.dumps({key: [1e12, 2e11, 3e-6]}))  # an older version's
        device_rates.cache_clear()
        assert device_rates("cpu").half_flops_per_second not in (None, 1e12)  # measured again
    finally:
        device_rates.cache_clear()


def test_a_fresh_measurement_taken_under_load_is_taken_again_before_it_is_used(tmp_path, monkeypatch):
    """The process that measures the rates plans with them; were an implausible measurement used and stored, the
    next process would measure again and plan otherwise."""
    import json

    from sublinear.profiling import costs

    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path))
    measurements = iter([costs.DeviceRates("cpu", 8.7e8, 3.6e10, 2e-6), costs.DeviceRates("cpu", 8e10, 2.4e10, 2e-6)])
    monkeypatch.setattr(costs, "_measure_rates", lambda dev: next(measurements))
    costs.device_rates.cache_clear()
    try:
        rates = costs.device_rates("cpu")
        assert (rates.flops_per_second, rates.bytes_per_second) == (8e10, 2.4e10)
        stored = json.loads((tmp_path / "device-rates.json").read_text())
        assert stored[costs.machine_key(torch.device("cpu"))][:2] == [8e10, 2.4e10]
    finally:
        costs.device_rates.cache_clear()


def test_implausible_cached_device_rates_are_measured_again(tmp_path, monkeypatch):
    """A matrix product slower than a copy (the matmul rate measured while other processes held the cores) is not
    believed: the rates are measured again and stored in its place."""
    import json

    from sublinear.profiling import costs

    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", str(tmp_path))
    key = costs.machine_key(torch.device("cpu"))
    (tmp_path / "device-rates.json").write_text(json.dumps({key: [8.7e8, 3.6e10, 2e-6]}))
    monkeypatch.setattr(costs, "_measure_rates", lambda dev: costs.DeviceRates(str(dev), 8e10, 2.4e10, 2e-6))
    costs.device_rates.cache_clear()
    try:
        rates = costs.device_rates("cpu")
        assert (rates.flops_per_second, rates.bytes_per_second) == (8e10, 2.4e10)
        assert json.loads((tmp_path / "device-rates.json").read_text())[key][:2] == [8e10, 2.4e10]
    finally:
        costs.device_rates.cache_clear()


def test_device_rates_are_measured_in_their_own_dtypes_under_a_callers_autocast(monkeypatch):
    """The rates are cached per machine: planning under bfloat16 autocast must not measure (and store) a bfloat16
    matrix product's rate as the float32 one; the half-precision product is measured in bfloat16 on CPU."""
    from sublinear.profiling import costs

    dtypes = []

    def first_result(fn, device, repeats=3):
        dtypes.append(fn().dtype)
        return 1e-3

    monkeypatch.setattr(costs, "_fastest", first_result)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        costs._measure_rates(torch.device("cpu"))
    assert dtypes == [torch.float32, torch.float32, torch.float32, torch.bfloat16]  # copy, call, the two products
