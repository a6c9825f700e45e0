"""Library kernels' memory: what a matrix product, convolution or attention kernel allocates inside one call.

Compiled code calls library kernels (oneDNN, cuBLAS, cuDNN, aten fallbacks) that allocate scratch space no
program statement shows: a convolution's backward on CPU reorders its inputs into oneDNN's layouts, attention keeps
per-thread buffers. Each distinct call (the call with every tensor argument's shape, stride and dtype) runs once,
alone on the device, on random tensors of those layouts, and the allocator's peak inside it is kept: in memory and,
per machine (device model, thread count, torch version), in the cache folder's ``kernel-memory.json``. The peak is
the same at every run of the same call, so it is measured whatever model times the ops. Calls of sublinear's own
operators (the chunked LM head) are kept in memory only: their allocations follow this package's code, which the
machine's key does not name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sublinear.cache import cache_dir, write_json
from sublinear.profiling.costs import cuda_peak, machine_key, range_peaks

__all__ = ["KernelMemory", "KernelRun", "Measured", "TensorLayout", "blas_workspace_bytes", "kernel_memory",
           "runs_cublaslt"]

log = logging.getLogger("sublinear.profiling.kernels")


CUBLASLT_OPS = frozenset({"aten::addmm", "aten::_addmm_activation"})  # aten products that reach cuBLASLt


def blas_workspace_bytes(device: torch.device | str, cublaslt: bool = True) -> int:
    """Bytes of the cuBLAS workspaces a training step on ``device`` holds beside its tensors (0 off CUDA). torch
    gives each thread's cuBLAS handle a workspace of ``torch.backends.cuda.cublas_workspace_size()`` bytes (32 MiB
    on Hopper by default), allocated through the caching allocator at the thread's first matrix product and kept.
    A step runs matrix products on two threads: the caller's, in forward, and autograd's thread for the device, in
    backward. ``cublaslt``: the step runs a product with a bias (:data:`CUBLASLT_OPS`), which takes cuBLASLt.
    cuBLASLt shares the cuBLAS workspace where they are unified, torch's default from 2.12 on; in torch 2.11 and
    earlier, or with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``, each thread running such a product gets a cuBLASLt
    workspace of its own too (1 MiB by default), counted for both threads, since a plan may re-run the product in
    backward."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return 0
    per_handle = _cublas_workspace_size(torch.device(device))
    if cublaslt and not _cublaslt_unified():
        query = getattr(torch.backends.cuda, "cublaslt_workspace_size", None)
        per_handle += query() if query is not None else 1024 * int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", 1024))
    return 2 * per_handle


def runs_cublaslt(targets: Iterable[Any]) -> bool:
    """Whether any of these call targets (aten overloads among others) is a product that takes cuBLASLt."""
    return any(isinstance(t, torch._ops.OpOverload) and t._schema.name in CUBLASLT_OPS for t in targets)


def _cublaslt_unified() -> bool:
    setting = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if setting is not None:
        return setting == "1"
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)


def _cublas_workspace_size(device: torch.device) -> int:
    """One cuBLAS handle's workspace. torch 2.11 and earlier have no query for it: the ``:SIZE:COUNT`` pairs of
    ``CUBLAS_WORKSPACE_CONFIG`` (KiB each), else torch's default, ``:4096:8`` (32 MiB) on compute capability 9.0
    and above and ``:4096:2:16:8`` below."""
    query = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    if query is not None:
        return query()
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        config = ":4096:8" if torch.cuda.get_device_capability(device)[0] >= 9 else ":4096:2:16:8"
    numbers = [int(v) for v in config.split(":") if v]
    return sum(1024 * size * count for size, count in zip(numbers[::2], numbers[1::2]))


@dataclass(frozen=True)
class TensorLayout:
    """A tensor argument's shape, stride and dtype (a dtype name as torch spells it: "float32")."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def make(self, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """A tensor of this layout: random floating values (drawn from ``generator``, not the global stream that
        training draws dropout from), zeros for integers (indices stay in range).

        A 0-d integer tensor is made on the CPU whatever the device: attention's dropout seed and offset are CPU
        scalars that its CUDA backward reads on the host (fake tensors place them on the GPU), and a device pointer
        there crashes the process; a kernel that wants the scalar on its device raises instead, which the
        measurement counts as no scratch."""
        dtype = getattr(torch, self.dtype)
        if not self.shape and not (dtype.is_floating_point or dtype.is_complex):
            return torch.zeros((), dtype=dtype)
        span = 1 + sum((s - 1) * abs(t) for s, t in zip(self.shape, self.stride)) if all(self.shape) else 0
        if dtype.is_floating_point or dtype.is_complex:
            base = torch.randn(span, dtype=dtype, device=device, generator=generator)
        else:
            base = torch.zeros(span, dtype=dtype, device=device)
        return base.as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class KernelRun:
    """One library call to measure: ``key`` names it with its arguments' layouts (equal keys, equal memory);
    ``run(tensors)`` calls it on tensors made from ``inputs`` (by name)."""

    key: str
    inputs: Mapping[str, TensorLayout]
    run: Callable[[dict[str, torch.Tensor]], Any]


@dataclass(frozen=True)
class Measured:
    """A call's allocator peak above what was allocated before it, and the dtypes of the tensors it returned."""

    inside_peak: int
    result_dtypes: tuple[str, ...]


@functools.cache
def kernel_memory(device: str) -> KernelMemory:
    """The library calls measured on ``device`` in this process (and on this machine, from the cache folder)."""
    return KernelMemory(torch.device(device))


class KernelMemory:
    """Measured library calls on one device (see the module docstring)."""

    def __init__(self, device: torch.device, use_disk: bool = True) -> None:
        self.device = torch.device(device)
        self._known: dict[str, Measured] = {}
        self._path = _cache_path() if use_disk else None
        self._machine = f"{self.device.type}|{machine_key(self.device)}"
        self._known.update(_read(self._path, self._machine))

    def get(self, key: str) -> Measured | None:
        return self._known.get(key)

    def remember(self, measured: Mapping[str, Measured]) -> None:
        """Keep peaks measured elsewhere (per key), in this process and on this machine's disk."""
        self._known.update(measured)
        if self._path is not None:
            _write(self._path, self._machine, measured)

    def measure(self, runs: Sequence[KernelRun]) -> None:
        """Measure every run whose key is not known yet (each distinct key once)."""
        todo = list({run.key: run for run in runs if run.key not in self._known}.values())
        if not todo:
            return
        if self.device.type == "cpu" and torch.autograd.profiler._is_profiler_enabled:
            log.warning("sublinear: a torch profiler is running, and measuring would end its session: the scratch of "
                        "%d library calls is not measured, and the peak predicted for this plan leaves it out. Plan "
                        "outside the profiler (run one training step before profiling) to count it", len(todo))
            return
        generator = torch.Generator(self.device).manual_seed(0)
        measure = _cpu_peaks if self.device.type == "cpu" else _cuda_peaks
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):  # a kernel drawing random numbers leaves
            measured = measure(todo, self.device, generator)  # the training's stream as it was
        self._known.update(measured)
        log.debug("measured %d library calls on %s", len(measured), self.device)
        if self._path is not None:
            _write(self._path, self._machine, measured)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _results(out: Any) -> tuple[str, ...]:
    """The dtype of each result by position ("" where an element of a result tuple is not a tensor)."""
    if isinstance(out, torch.Tensor):
        return (_dtype_name(out),)
    if isinstance(out, (tuple, list)):
        return tuple(_dtype_name(t) if isinstance(t, torch.Tensor) else "" for t in out)
    return ()


def _cpu_peaks(runs: Sequence[KernelRun], device: torch.device, generator: torch.Generator) -> dict[str, Measured]:
    """Each run inside a named profiler range; its peak from the CPU allocator's memory events in the range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    results: dict[str, tuple[str, ...]] = {}
    ran: set[str] = set()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for k, run in enumerate(runs):
            tensors = {name: layout.make(device, generator) for name, layout in run.inputs.items()}
            with record_function(f"sublinear-kernel-{k}"):
                try:
                    out = run.run(tensors)
                except Exception as exc:  # noqa: BLE001 - counted as allocating nothing
                    log.debug("library call %s not measured: %s", run.key[:120], exc)
                    continue
            ran.add(run.key)
            results[run.key] = _results(out)
            del out, tensors
    peaks = range_peaks(prof, "sublinear-kernel-")
    return {run.key: Measured(peaks.get(f"sublinear-kernel-{k}", 0) if run.key in ran else 0,
                              results.get(run.key, ()))
            for k, run in enumerate(runs)}


def _cuda_peaks(runs: Sequence[KernelRun], device: torch.device, generator: torch.Generator) -> dict[str, Measured]:
    measured = {}
    for run in runs:
        tensors = {name: layout.make(device, generator) for name, layout in run.inputs.items()}
        try:
            out, peak = cuda_peak(functools.partial(run.run, tensors), device)
        except Exception as exc:  # noqa: BLE001 - counted as allocating nothing
            log.debug("library call %s not measured: %s", run.key[:120], exc)
            measured[run.key] = Measured(0, ())
            continue
        measured[run.key] = Measured(peak, _results(out))
        del out, tensors
    return measured


def _cache_path() -> Path | None:
    folder = cache_dir(None)
    return folder / "kernel-memory.json" if folder is not None else None


def _own_operator(key: str) -> bool:
    """Whether ``key`` calls one of sublinear's operators (``torch.ops.sublinear.*`` or a function of this package)."""
    return "sublinear." in key


def _read(path: Path | None, machine: str) -> dict[str, Measured]:
    if path is None or not path.exists():
        return {}
    try:
        table = json.loads(path.read_text()).get(machine, {})
        return {key: Measured(int(v[0]), tuple(v[1])) for key, v in table.items() if not _own_operator(key)}
    except (OSError, ValueError, AttributeError, TypeError, IndexError):
        return {}


def _write(path: Path, machine: str, measured: Mapping[str, Measured]) -> None:
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    table = known.setdefault(machine, {})
    table.update({key: [m.inside_peak, list(m.result_dtypes)] for key, m in measured.items()
                  if not _own_operator(key)})
    try:
        write_json(path, known)
    except OSError as exc:
        log.info("library call memory not cached in %s: %s", path.parent, exc)
