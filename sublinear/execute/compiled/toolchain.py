"""Inductor's one-time probe of the CPU's vector instruction sets, run while sublinear captures and plans.

Before the first C++ kernel of a process, inductor builds and loads a test program for each vector instruction set
the CPU reports (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``, cached for the process; with a cold inductor
cache, several C++ builds and interpreter starts). Its result depends only on the machine and inductor's config,
not on any graph, and the work is in subprocesses, so a background thread runs it from the first training call on,
while TorchDynamo captures and sublinear profiles and searches; the compile waits for it before inductor needs it.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["start_isa_probe", "wait_for_isa_probe"]

log = logging.getLogger("sublinear")

_lock = threading.Lock()
_probe: threading.Thread | None = None


def start_isa_probe(device_type: str) -> None:
    """Start the probe in the background, once per process, where inductor will compile C++ kernels (the CPU)."""
    global _probe
    if device_type != "cpu":
        return
    with _lock:
        if _probe is None:
            _probe = threading.Thread(target=_probe_isas, name="sublinear-inductor-isa-probe", daemon=True)
            _probe.start()


def wait_for_isa_probe() -> None:
    """Return once a started probe has finished, so that inductor reads its cached result and never probes twice."""
    if _probe is not None:
        _probe.join()


def _probe_isas() -> None:
    """Each instruction set's check is its own build and load, cached on the set's object, so on x86 the checks of
    the sets the CPU reports run side by side; inductor's list then reads their cached results."""
    import platform

    from torch._inductor import cpu_vec_isa

    try:
        if platform.machine() in ("x86_64", "AMD64"):
            reported = cpu_vec_isa.x86_isa_checker()
            checks = [threading.Thread(target=bool, args=(isa,), daemon=True)
                      for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in reported for flag in str(isa).split())]
            for check in checks:
                check.start()
            for check in checks:
                check.join()
        cpu_vec_isa.valid_vec_isa_list()
    except Exception as exc:  # noqa: BLE001 - nothing is cached then: inductor probes again and raises its own error
        log.debug("sublinear: inductor's vector instruction set probe failed in the background: %s", exc)
