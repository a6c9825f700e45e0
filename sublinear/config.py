"""``SublinearMemoryConfig``: the planner's knobs, named as in MegEngine."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields

__all__ = ["SublinearMemoryConfig", "parse_size"]


@dataclass(frozen=True)
class SublinearMemoryConfig:
    """Planner settings. Sizes are bytes (``lb_memory`` and ``memory_budget`` also take ``"11GiB"``-style text).

    thresh_nr_try: grid points per phase of the threshold grid search (>= 0).
    genetic_nr_iter: generations of the genetic refinement; 0 turns it off.
    genetic_pool_size: survivors per generation (>= 2 when the genetic search runs).
    lb_memory: floor; a plan below it keeps expensive ops until it reaches the floor (>= 0).
    num_worker: processes that score genetic candidates; None means max(1, cpu_count // 2).
    memory_budget: when set, the plan with the least recompute whose predicted peak fits (> 0).
    seed: seed of the genetic search; the same seed gives the same plan.
    cache_dir: plan cache folder; None uses $SUBLINEAR_CACHE_DIR or the user cache dir; "" disables it.
    """

    thresh_nr_try: int = 10
    genetic_nr_iter: int = 0
    genetic_pool_size: int = 20
    lb_memory: int = 0
    num_worker: int | None = None
    memory_budget: int | None = None
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("lb_memory", "memory_budget"):
            if isinstance(getattr(self, name), str):
                try:
                    object.__setattr__(self, name, parse_size(getattr(self, name)))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        _int_at_least("thresh_nr_try", self.thresh_nr_try, 0)
        _int_at_least("genetic_nr_iter", self.genetic_nr_iter, 0)
        _int_at_least("genetic_pool_size", self.genetic_pool_size, 1)
        if self.genetic_nr_iter > 0 and self.genetic_pool_size < 2:
            raise ValueError(f"genetic_pool_size must be >= 2 when genetic_nr_iter > 0 (crossover needs two "
                             f"parents); got {self.genetic_pool_size}")
        _int_at_least("lb_memory", self.lb_memory, 0)
        if self.num_worker is not None:
            _int_at_least("num_worker", self.num_worker, 1, "or None")
        if self.memory_budget is not None:
            _int_at_least("memory_budget", self.memory_budget, 1, "(bytes) or None")
        _int_at_least("seed", self.seed, 0)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir must be a path, '' (no cache) or None; got {type(self.cache_dir).__name__}")

    @property
    def workers(self) -> int:
        """Scoring processes actually used."""
        return self.num_worker if self.num_worker is not None else max(1, (os.cpu_count() or 1) // 2)

    def planning_key(self) -> dict:
        """Fields that change the plan (for cache keys): everything but where the cache lives and worker count."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cache_dir", "num_worker")}


def _int_at_least(name: str, value: object, low: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {low}{' ' + extra if extra else ''}; "
                         f"got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}{' ' + extra if extra else ''}; got {value}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``11GiB``, ``500MB``, ``1.5 GiB`` or a raw integer."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 11GiB, 500MB or a number of bytes)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return int(value)
