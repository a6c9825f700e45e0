"""Op costs: how long each operator node takes on the device, forward and backward, and how many bytes the
allocator hands it while it runs (kernel workspace included).

Two sources:

- :func:`measure_node_costs` runs every node alone on the device, on random tensors of the shapes, dtypes and
  strides it saw in the profiled step (integers are zeros, so indices stay in range), forward then backward.
  Time: CPU wall clock, or CUDA events on a GPU; the fastest of ``repeats`` runs after one warm-up. Memory: the
  allocator's peak during the node (CPU: the profiler's memory events; CUDA: ``max_memory_allocated``). One node at
  a time, so it needs the memory of one node's inputs and outputs, not of the step.
- :func:`estimate_seconds` charges every aten call FLOPs over the device's matmul rate for its dtype (a
  half-precision call, as autocast runs products, at the half-precision rate) plus bytes moved over its memory
  bandwidth plus a fixed per-call overhead, with :class:`DeviceRates` calibrated once per process on the
  device (on meta, a reference GPU's published rates). Elementwise ops are never free.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from sublinear.cache import cache_dir, write_json

__all__ = ["DeviceRates", "NodeCosts", "StepCost", "TensorSpec", "aten_work", "computes_in_half", "device_model",
           "device_rates", "estimate_seconds", "measure_node_costs", "measure_node_memory"]

log = logging.getLogger("sublinear.profiling.costs")
# a cached entry is these, in this order; an entry of another length (an older version's) is measured again
_CACHED_FIELDS = ("flops_per_second", "bytes_per_second", "seconds_per_call", "half_flops_per_second")


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs that turn FLOPs and bytes into seconds on one device."""

    device: str
    flops_per_second: float  # a float32 matrix product's
    bytes_per_second: float
    seconds_per_call: float  # launch and dispatch overhead of one aten call
    # A half-precision matrix product's (bfloat16 where the device has it, else float16: what autocast runs on tensor
    # cores, often ten times the float32 rate); None where unmeasured (the reference GPU): the float32 rate stands in.
    half_flops_per_second: float | None = None

    def matmul_flops_per_second(self, itemsize: int) -> float:
        """The matrix-product rate for operands of ``itemsize`` bytes."""
        return self.half_flops_per_second if itemsize == 2 and self.half_flops_per_second else self.flops_per_second

    def describe(self) -> str:
        half = (f" ({self.half_flops_per_second / 1e12:.2f} in half precision)" if self.half_flops_per_second
                else "")
        return (f"{self.device}: {self.flops_per_second / 1e12:.2f} TFLOP/s{half}, "
                f"{self.bytes_per_second / 1e9:.0f} GB/s, {self.seconds_per_call * 1e6:.0f} us per call")


# The GPU MegEngine's published figures were taken on (NVIDIA RTX 2080 Ti: 13.4 TFLOP/s fp32, 616 GB/s), used
# when planning on the meta device, where nothing can be timed.
REFERENCE_GPU = DeviceRates("reference GPU (RTX 2080 Ti)", 13.4e12, 616e9, 5e-6)


def estimate_seconds(flops: float, io_bytes: float, calls: int, rates: DeviceRates, half_flops: float = 0) -> float:
    """Roofline-style time of ``calls`` aten calls doing ``flops`` and moving ``io_bytes``; ``half_flops`` of those
    FLOPs are computed in a half-precision dtype and run at its rate."""
    return ((flops - half_flops) / rates.flops_per_second + half_flops / rates.matmul_flops_per_second(2)
            + io_bytes / rates.bytes_per_second + calls * rates.seconds_per_call)


def computes_in_half(out: Any) -> bool:
    """Whether a call whose result is ``out`` computes in a 2-byte floating dtype (its first floating result's): a
    product under autocast returns the dtype it multiplied in."""
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.element_size() == 2
    return False


_aten = torch.ops.aten
# Calls that allocate without writing, or that return a tensor sharing its input's storage although their schema
# declares no alias (``_unsafe_view`` reinterprets a temporary in place): no data moves.
_NO_TRAFFIC = frozenset({_aten.empty_like, _aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
                         _aten._unsafe_view})
# Calls that read only the metadata of their tensor arguments and write their result.
_WRITE_ONLY = frozenset({_aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.rand_like, _aten.randn_like,
                         _aten.randint_like, _aten.new_zeros, _aten.new_ones, _aten.new_full})


def aten_work(func, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """(FLOPs, bytes read and written) of one aten call: torch.utils.flop_counter's formulas (0 for ops it has none
    for; counted in whatever dtype the call computes, see :func:`computes_in_half`); each tensor argument read once
    over the memory its view spans (a broadcast mask is its storage, not its expanded size), each result written in
    full. Views, aliases and bare allocations move nothing."""
    count = flop_registry.get(func._overloadpacket)
    flops = count(*args, **kwargs, out_val=out) if count is not None else 0
    if func.is_view or func._overloadpacket in _NO_TRAFFIC:
        return int(flops), 0
    written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    if func._overloadpacket in _WRITE_ONLY:
        return int(flops), int(written)
    read = sum(_span_bytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    return int(flops), int(read + written)


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a view covers: its elements, or fewer where strides repeat them (0-stride broadcasts)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(t.numel(), span) * t.element_size()


class StepCost(TorchDispatchMode):
    """FLOPs and estimated seconds (:func:`estimate_seconds` over ``rates``) of every aten call run inside it: the
    planner's cost model applied to any step, such as a hand-written checkpointing strategy's."""

    def __init__(self, rates: DeviceRates) -> None:
        super().__init__()
        self.rates = rates
        self.flops = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, moved = aten_work(func, args, kwargs, out)
        self.flops += flops
        self.seconds += estimate_seconds(flops, moved, 1, self.rates, flops if computes_in_half(out) else 0)
        return out


@functools.lru_cache(maxsize=None)
def device_rates(device: str) -> DeviceRates:
    """The device's matmul rate, copy bandwidth and per-call overhead. Measured once per machine (0.1-0.5 s) and
    kept in the cache folder (``device-rates.json``, per device model, thread count and torch version), so that
    every process on the machine estimates op times alike and plans alike; measured per process when the cache
    folder is disabled."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        return REFERENCE_GPU
    dev = torch.device(device)
    key = machine_key(dev)
    folder = cache_dir(None)
    path = folder / "device-rates.json" if folder is not None else None
    known = _read_rates(path)
    cached = DeviceRates(str(dev), *known[key]) if key in known else None
    if cached is not None and _plausible(cached):
        rates = cached
    else:
        if cached is not None:
            log.warning("sublinear: the device rates cached for %s (%s) are implausible, measured under load; "
                        "measuring them again", key, cached.describe())
        rates = _measure_plausible_rates(dev)
        if path is not None:
            _write_rates(path, {**_read_rates(path), key: [getattr(rates, name) for name in _CACHED_FIELDS]})
    log.info("device rates %s", rates.describe())
    return rates


_MEASURE_TRIES = 5


def _measure_plausible_rates(dev: torch.device) -> DeviceRates:
    """The rates, measured again while implausible (up to ``_MEASURE_TRIES`` times): a measurement taken under load
    and stored would be used by this process but measured again by the next one, which would then plan otherwise."""
    for _ in range(_MEASURE_TRIES):
        rates = _measure_rates(dev)
        if _plausible(rates):
            break
    return rates


def _plausible(rates: DeviceRates) -> bool:
    """Whether a 1024-wide float32 matrix product ran at more FLOPs per second than a copy moved bytes: true of every
    CPU and GPU idle (3-30 FLOPs per byte); a measurement taken while other processes held the cores can fall a
    hundred times below."""
    return rates.flops_per_second >= rates.bytes_per_second


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def _measure_rates(dev: torch.device) -> DeviceRates:
    """The rates, whatever autocast the caller plans under (they are cached per machine). The half-precision
    product is smaller on CPU, where one without bfloat16 units runs it a hundred times slower than float32."""
    big = torch.empty(32 * 2**20 // 4, device=dev)
    out = torch.empty_like(big)
    copy = _fastest(lambda: out.copy_(big), dev)
    one = torch.ones(1, device=dev)
    call = _fastest(lambda: one.add(one), dev, repeats=50)
    half = torch.bfloat16 if dev.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    return DeviceRates(str(dev), _matmul_rate(dev, torch.float32, 1024 if dev.type == "cpu" else 4096),
                       2 * big.nbytes / copy, call, _matmul_rate(dev, half, 256 if dev.type == "cpu" else 4096))


def _matmul_rate(dev: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOPs per second of an ``n``-wide square matrix product in ``dtype``."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n**3 / _fastest(lambda: torch.mm(a, b), dev)


def machine_key(dev: torch.device) -> str:
    """What a measurement on ``dev`` depends on beyond the call: the device model, the thread count, torch."""
    return f"{device_model(dev)}|threads {torch.get_num_threads()}|torch {torch.__version__}"


def device_model(dev: torch.device) -> str:
    """The device's model name (the GPU's, or the CPU's from /proc/cpuinfo)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def _read_rates(path: Path | None) -> dict[str, list[float]]:
    if path is None or not path.exists():
        return {}
    try:
        known = json.loads(path.read_text())
        return {k: v for k, v in known.items() if isinstance(v, list) and len(v) == len(_CACHED_FIELDS)} \
            if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_rates(path: Path, known: dict[str, list[float]]) -> None:
    try:
        write_json(path, known)
    except OSError as exc:
        log.info("device rates not cached in %s: %s", path.parent, exc)


def _fastest(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        times.append(_timed(fn, device))
    return max(min(times), 1e-9)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------------------
# Measuring nodes


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's metadata, enough to make a random stand-in for it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    def make(self, device: torch.device) -> torch.Tensor:
        """A random tensor with this metadata; a non-leaf when it requires grad (so in-place ops may write it)."""
        size = sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1 if all(self.shape) else 0
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.randn(size, dtype=self.dtype, device=device) * 0.1
        else:
            base = torch.zeros(size, dtype=self.dtype, device=device)
        t = base.as_strided(self.shape, self.stride)
        if self.requires_grad and (self.dtype.is_floating_point or self.dtype.is_complex):
            leaf = t.detach().requires_grad_(True)
            return leaf * 1
        return t


def spec_tree(value: Any) -> Any:
    """``value`` with every tensor replaced by its :class:`TensorSpec` (holds no tensor alive)."""
    return tree_map(lambda v: TensorSpec.of(v) if isinstance(v, torch.Tensor) else v, value)


@dataclass
class NodeCosts:
    """Per operator node: forward and backward seconds, and the allocator's peak bytes above what was allocated
    before the node's forward (its outputs and workspace) and before its backward (gradients and workspace)."""

    forward_seconds: dict[int, float]
    backward_seconds: dict[int, float]
    forward_peak_bytes: dict[int, int]
    backward_peak_bytes: dict[int, int]


def measure_node_memory(nodes: Sequence[int], call: Callable[[int, tuple, dict], Any],
                        inputs: dict[int, tuple[Any, Any]], device: torch.device,
                        signatures: dict[int, str]) -> tuple[dict[int, int], dict[int, int]]:
    """The allocator's peak per node in its forward and in its backward (as :func:`measure_node_costs` measures
    them), each node run once; nodes whose signature (what they call, on which argument layouts, in which modes)
    was measured before on this machine are looked up (:mod:`sublinear.profiling.kernels`' store)."""
    from sublinear.profiling.kernels import Measured, kernel_memory  # noqa: PLC0415

    store = kernel_memory(str(device))
    known = {i: (store.get(signatures[i] + "|forward"), store.get(signatures[i] + "|backward")) for i in nodes}
    todo = [i for i in nodes if None in known[i]]
    if todo:
        peaks = _cpu_peaks if device.type == "cpu" else _cuda_peaks
        forward, backward = peaks(todo, call, inputs, device)
        store.remember({**{signatures[i] + "|forward": Measured(forward.get(i, 0), ()) for i in todo},
                        **{signatures[i] + "|backward": Measured(backward.get(i, 0), ()) for i in todo}})
        known.update({i: (Measured(forward.get(i, 0), ()), Measured(backward.get(i, 0), ())) for i in todo})
    return ({i: known[i][0].inside_peak for i in nodes}, {i: known[i][1].inside_peak for i in nodes})


def measure_node_costs(nodes: Sequence[int], call: Callable[[int, tuple, dict], Any],
                       inputs: dict[int, tuple[Any, Any]], device: torch.device, repeats: int = 2) -> NodeCosts:
    """Time and allocator peaks of every node in ``nodes``, each run alone by ``call(node, args, kwargs)`` on random
    stand-ins for ``inputs[node]`` (its args and kwargs as :class:`TensorSpec` trees)."""
    costs = NodeCosts({}, {}, {}, {})
    for i in nodes:
        args, kwargs = inputs[i]
        forward, backward = [], []
        for _ in range(repeats + 1):
            a, k = _materialise((args, kwargs), device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out, seconds = _timed_call(functools.partial(call, i, a, k), device)
            forward.append(seconds)
            grads = _backward_pair(out, (a, k))
            if grads is not None:
                backward.append(_timed(functools.partial(torch.autograd.grad, *grads, allow_unused=True), device))
            del out, grads, a, k
        costs.forward_seconds[i] = min(forward[1:])
        costs.backward_seconds[i] = min(backward[1:]) if len(backward) > 1 else 0.0
    peaks = _cpu_peaks if device.type == "cpu" else _cuda_peaks
    costs.forward_peak_bytes, costs.backward_peak_bytes = peaks(nodes, call, inputs, device)
    return costs


def _materialise(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, tree)


def _timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    result: list[Any] = []
    seconds = _timed(lambda: result.append(fn()), device)
    return result[0], seconds


def _backward_pair(out: Any, inputs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
    """(outputs, inputs, grad_outputs) for the node's backward, or None when nothing is differentiable."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
    ins = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not ins:
        return None
    return outs, ins, [torch.ones_like(t) for t in outs]


def _cpu_peaks(nodes, call, inputs, device) -> tuple[dict[int, int], dict[int, int]]:
    """Allocator peaks per node from one profiler session, each node's forward and backward in a named range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in nodes:
            a, k = _materialise(inputs[i], device)
            with record_function(f"sublinear-forward-{i}"):
                out = call(i, a, k)
            grads = _backward_pair(out, (a, k))
            if grads is not None:
                with record_function(f"sublinear-backward-{i}"):
                    torch.autograd.grad(*grads, allow_unused=True)
            del out, grads, a, k
    peaks = range_peaks(prof, "sublinear-")
    forward = {i: peaks.get(f"sublinear-forward-{i}", 0) for i in nodes}
    backward = {i: peaks.get(f"sublinear-backward-{i}", 0) for i in nodes}
    return forward, backward


def range_peaks(prof: Any, prefix: str) -> dict[str, int]:
    """Per ``record_function`` range of a finished CPU profiler session whose name starts with ``prefix``: the most
    bytes the CPU allocator held at once inside it, counted from zero at its start."""
    from torch.autograd import DeviceType

    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    peaks = {}
    for e in events:
        if e.name().startswith(prefix):
            start, stop = e.start_ns(), e.start_ns() + e.duration_ns()
            live = peak = 0
            for t, nbytes in memory:
                if t > stop:
                    break
                if t >= start:
                    live += nbytes
                    peak = max(peak, live)
            peaks[e.name()] = peak
    return peaks


def _cuda_peaks(nodes, call, inputs, device) -> tuple[dict[int, int], dict[int, int]]:
    forward, backward = {}, {}
    for i in nodes:
        a, k = _materialise(inputs[i], device)
        out, forward[i] = cuda_peak(functools.partial(call, i, a, k), device)
        grads = _backward_pair(out, (a, k))
        backward[i] = 0
        if grads is not None:
            backward[i] = cuda_peak(functools.partial(torch.autograd.grad, *grads, allow_unused=True), device)[1]
        del out, grads, a, k
    return forward, backward


def cuda_peak(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """``fn()``'s result and the most bytes the CUDA allocator held beyond what was allocated when it started."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


