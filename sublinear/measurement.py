"""``sublinear.measure``: the exact peak memory of one step, on CPU, meta or CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from sublinear.core.units import format_bytes
from sublinear.profiling.attention import FusedAttentionOnMeta
from sublinear.profiling.tracking import StorageTracker, storages_of

__all__ = ["MemoryReport", "measure", "measure_cpu_allocator"]


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one call of a step function, in bytes.

    ``peak_bytes`` is everything live at the step's peak: parameters, buffers and tensor arguments that existed
    before the step (``baseline_bytes``), plus what the step allocated and still held at that moment (activations,
    temporaries, gradients). ``activation_peak_bytes`` is the peak of the step's own allocations other than the
    parameter gradients; ``gradient_bytes`` are the parameter gradients alive when the step returns.
    """

    peak_bytes: int
    baseline_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    activation_peak_bytes: int
    device: str
    method: str

    def __str__(self) -> str:
        return (f"peak {format_bytes(self.peak_bytes)} on {self.device} ({self.method}): "
                f"parameters {format_bytes(self.parameter_bytes)}, buffers {format_bytes(self.buffer_bytes)}, "
                f"inputs {format_bytes(self.input_bytes)}, gradients {format_bytes(self.gradient_bytes)}, "
                f"activation peak {format_bytes(self.activation_peak_bytes)}")


def measure(step: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Run ``step(*args, **kwargs)`` once and report its peak memory.

    Modules found among the arguments contribute their parameters and buffers to the baseline, tensors
    contribute themselves. On CPU and meta every storage returned by an aten op is tracked until released
    (views and in-place results count once); on meta, scaled dot-product attention runs the fused kernel CPU
    would (:class:`~sublinear.profiling.attention.FusedAttentionOnMeta`), not the math path meta has. On CUDA
    the caching allocator's ``max_memory_allocated`` is read after a reset, so the figure is the allocator's
    (512-byte rounded) truth.
    """
    modules, tensors, (param_bytes, buffer_bytes, input_bytes) = _arguments(args, kwargs)
    device = _device_of(modules, tensors)

    if device.type == "cuda":
        return _measure_cuda(step, args, kwargs, modules, device, param_bytes, buffer_bytes, input_bytes)

    events: list[tuple[str, int, int]] = []
    serial_of: dict[int, int] = {}
    counter = iter(range(1 << 62))

    def listener(kind: str, key: int, nbytes: int) -> None:
        if kind == "alloc":
            serial_of[key] = next(counter)
            events.append((kind, serial_of[key], nbytes))
        elif key in serial_of:  # storages that existed before the step have no serial
            events.append((kind, serial_of.pop(key), nbytes))

    tracker = StorageTracker()
    tracker.track(p for m in modules for p in m.parameters())
    tracker.track(b for m in modules for b in m.buffers())
    tracker.track(tensors)
    baseline = tracker.live_bytes
    tracker.listener = listener
    with tracker, FusedAttentionOnMeta() if device.type == "meta" else contextlib.nullcontext():
        step(*args, **kwargs)
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    grad_serials = {serial_of[st._cdata] for st in storages_of(grads) if st._cdata in serial_of}
    return MemoryReport(
        peak_bytes=tracker.peak_bytes,
        baseline_bytes=baseline,
        parameter_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        gradient_bytes=_bytes(storages_of(grads)),
        activation_peak_bytes=_peak_excluding(events, grad_serials),
        device=str(device),
        method="storage-tracking",
    )


def measure_cpu_allocator(step: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Like :func:`measure`, but the CPU allocator's own count, read from the profiler's memory events.

    It sees what storage tracking cannot: storages that are resized in place, as FSDP2 frees and re-gathers its
    parameters. Every CPU allocation of the profiled threads counts, at its requested size, and a release counts
    only for a block allocated within the step: torch's CPU allocator keeps the size of a block allocated while a
    profiler counted memory until the block is freed with one counting, so a block freed between two counts leaves
    its size behind, and a later block at the same address, made before the step and freed in it, would be
    subtracted at that stale size. A buffer released on a thread the profiler does not observe (a gloo worker that
    drops the last reference to a collective's output) is never subtracted, so one step's count can exceed the
    truth by that buffer, never fall below it: take the minimum of a few steps.
    """
    from torch.profiler import ProfilerActivity, profile

    modules, tensors, (param_bytes, buffer_bytes, input_bytes) = _arguments(args, kwargs)
    baseline = param_bytes + buffer_bytes + input_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(*args, **kwargs)
        if not torch.autograd.profiler._is_profiler_enabled:
            raise RuntimeError("the step ended the profiler session that counts its allocations (it ran a torch "
                               "profiler of its own), so the count is incomplete: measure a step that profiles "
                               "nothing")
    peak = step_peak(_cpu_allocations(prof.profiler.kineto_results.experimental_event_tree()))
    return _allocator_report(modules, baseline + peak, baseline, param_bytes, buffer_bytes, input_bytes, "cpu",
                             "cpu-allocator")


def step_peak(allocations: Sequence[tuple[int, int, int]]) -> int:
    """The most bytes live at once from ``allocations`` ((time, address, bytes: negative where released), in time
    order), counting a release only for a block allocated among them."""
    live = peak = 0
    made: set[int] = set()  # addresses of the blocks allocated in the step and not yet released
    for _, address, nbytes in allocations:
        if nbytes > 0:
            made.add(address)
        elif address in made:
            made.discard(address)
        else:
            continue
        live += nbytes
        peak = max(peak, live)
    return peak


def _cpu_allocations(roots) -> list[tuple[int, int, int]]:
    """(time, address, bytes: negative where released) of every CPU allocator event under the profiler's events,
    in time order."""
    from torch._C._profiler import _EventType

    found, stack = [], list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    return sorted(found)


def _measure_cuda(step, args, kwargs, modules, device, param_bytes, buffer_bytes, input_bytes) -> MemoryReport:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    step(*args, **kwargs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return _allocator_report(modules, peak, baseline, param_bytes, buffer_bytes, input_bytes, str(device),
                             "cuda-allocator")


def _allocator_report(modules, peak, baseline, param_bytes, buffer_bytes, input_bytes, device, method) -> MemoryReport:
    """A report from an allocator's peak: the activation peak is what is left after the baseline and gradients."""
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    grad_bytes = _bytes(storages_of(grads))
    return MemoryReport(
        peak_bytes=peak,
        baseline_bytes=baseline,
        parameter_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        gradient_bytes=grad_bytes,
        activation_peak_bytes=max(0, peak - baseline - grad_bytes),
        device=device,
        method=method,
    )


def _arguments(args, kwargs) -> tuple[list[nn.Module], list[torch.Tensor], tuple[int, int, int]]:
    """The modules and tensors among a step's arguments, and their parameter, buffer and input bytes."""
    modules = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, nn.Module)]
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    params = _unique_storages(p for m in modules for p in m.parameters())
    buffers = _unique_storages(b for m in modules for b in m.buffers()) - params
    inputs = _unique_storages(tensors) - params - buffers
    return modules, tensors, tuple(_bytes(s) for s in (params, buffers, inputs))


def _unique_storages(tensors) -> set:
    return {(st._cdata, st.nbytes()) for st in storages_of(list(tensors))}


def _bytes(storages) -> int:
    if isinstance(storages, set):
        return sum(nbytes for _, nbytes in storages)
    return sum(st.nbytes() for st in storages)


def _device_of(modules: list[nn.Module], tensors: list[torch.Tensor]) -> torch.device:
    for t in [*(p for m in modules for p in m.parameters()), *tensors]:
        return t.device
    return torch.device("cpu")


def _peak_excluding(events: list[tuple[str, int, int]], excluded: set[int]) -> int:
    live = peak = 0
    for kind, serial, nbytes in events:
        if serial in excluded:
            continue
        live += nbytes if kind == "alloc" else -nbytes
        peak = max(peak, live)
    return peak
