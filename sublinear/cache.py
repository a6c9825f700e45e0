"""Plan lookups: the search result for one graph, call signature and config, found again in this session's memory
(a dry run's plans serve the real calls) or on disk, across processes (:class:`PlanCache`).

Disk entries are JSON files named by a SHA-256 key of the captured graph's code, the shapes, strides, dtypes and
devices of every graph input (parameters and buffers included: Dynamo lifts them to inputs), the autocast state,
the FSDP layout, the planning config and the library versions. Each entry holds the plan, its search history and
the op costs measured on the device, so a hit skips the search and the timing runs. Writes are atomic (a temporary
file renamed into place). An entry that cannot be used, for any reason (corrupt JSON, JSON of another shape, a plan
that does not fit the graph), is ignored with a warning and replaced by the next search.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sublinear.core.plan import Plan, PlanError

__all__ = ["PlanCache", "Recent", "cache_dir", "write_json"]

log = logging.getLogger("sublinear.cache")
_FORMAT = 35  # 35: a fused backward output may take a channels-last convolution's result in that layout, what a
# late re-run reads is held until the kernel after its rank's call has run, and a forward value read past its rank's
# release is held to its last kernel; 34: a forward kernel holds its buffers from its first op to its last, a kernel's
# output written into a saved value is not counted above the value's reader in that kernel, inductor's seeds are a
# library call, and a re-run
# holds nothing its forward kernel makes early; 33: a re-run op reads only what the values backward needs are made from;
# 32: a re-run copy may take the buffer of a kept storage it reads last; 31: a library kernel and its views are an op
# apart from the values around them; 30: a re-run node's values are made together, a late re-run is held through the
# kernel below; 28: a convolution's argument that is a part of a larger buffer keeps its layout; 27: a value a re-run
# fused value is made from is held until that value's backward reader; 26: a gradient a channels-last convolution's
# backward reads is stored channels-last (the compiled code, and so the lessons taught by it, changed); 25: a split
# step's context counts the eager code between its graphs; 24: what a gradient inlined after a re-run reads is held
# through the re-run; 23: a pooled gradient a channels-last convolution backward shares is copied beside it; 22: a
# forward value read last by a kernel before its rank's release is freed there; 20: on meta, convolutions' layout copies
# are counted; 19: a value a sum reads stays for a value made from that sum through another loop, and a channels-last
# convolution reads a reshaped value with no copy; 18: a value re-run after its rank's library call takes memory from
# there; 17: a convolution's layout copies are made by the kernel before it; 16: a value is reused where its views are;
# 15: a view of a computed value loads its buffers anew; 14: as_strided stores what it views, and backward values only
# library calls read are stored in place; 13: outputs written into saved values count from their readers; 12: re-runs
# fused with backward readers; 11: only library kernels' results keep re-run copies at their readers' ranks; 10: lessons
# differ


def cache_dir(configured: str | os.PathLike | None) -> Path | None:
    """The cache folder: the config's, else $SUBLINEAR_CACHE_DIR, else the user cache dir; None when disabled."""
    if configured is not None:
        return Path(configured).expanduser() if str(configured) else None
    env = os.environ.get("SUBLINEAR_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sublinear"


class Recent:
    """A small store that forgets its least recently used entry beyond ``size`` entries."""

    def __init__(self, size: int = 64) -> None:
        self.entries: OrderedDict[tuple, Any] = OrderedDict()
        self.size = size

    def get(self, key: tuple) -> Any:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple, value: Any) -> None:
        self.entries[key] = value
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


class PlanCache:
    """Where a session finds plans made before: :meth:`recall` and :meth:`remember` this session's (in memory, keyed
    by graph, signature, context and config), :meth:`load`, :meth:`check` and :meth:`store` every process's (on disk,
    in the folder ``configured`` names, read at each use as :func:`cache_dir` resolves it)."""

    def __init__(self, configured: str | os.PathLike | None, size: int = 64) -> None:
        self.configured = configured
        self.recent = Recent(size)

    @property
    def folder(self) -> Path | None:
        return cache_dir(self.configured)

    def recall(self, key: tuple) -> Any:
        """What this session planned for ``key``, or None."""
        return self.recent.get(key)

    def remember(self, key: tuple, entry: Any) -> None:
        self.recent.put(key, entry)

    def graph_codes(self) -> set[str]:
        """The graphs this session remembers plans for."""
        return {key[0] for key in self.recent.entries}

    @staticmethod
    def key(**parts: object) -> str:
        """A key over ``parts`` (graph code, signature, config, ...) and the library versions."""
        import torch

        from sublinear import __version__

        text = json.dumps({**parts, "torch": torch.__version__, "sublinear": __version__, "format": _FORMAT},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> dict | None:
        """The stored entry as a JSON object, or None (missing, disabled, or unreadable: then a warning says
        why). :meth:`check` it against the graph before use."""
        folder = self.folder
        if folder is None:
            return None
        path = folder / f"{key}.json"
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if not isinstance(entry, dict):
                raise ValueError(f"expected a JSON object, found {type(entry).__name__}")
        except (OSError, ValueError) as exc:
            self._ignore(key, exc)
            return None
        return entry

    def check(self, entry: dict, key: str, num_ops: int) -> dict | None:
        """``entry`` when it holds a valid plan for a graph of ``num_ops`` ops with its history and costs."""
        try:
            if entry.get("format") != _FORMAT or entry.get("key") != key or entry.get("num_ops") != num_ops:
                raise ValueError("entry does not belong to this graph")
            Plan.from_dict(entry).validate(num_ops)
            if not isinstance(entry.get("history"), list) or not isinstance(entry.get("costs"), dict):
                raise ValueError("entry lacks its history or costs")
            costs = entry["costs"]
            if len(costs["forward_seconds"]) != num_ops or len(costs["grad_peak"]) != len(costs["grad_after_release"]):
                raise ValueError("entry's costs belong to another graph")
        except (ValueError, KeyError, TypeError, AttributeError, PlanError) as exc:
            self._ignore(key, exc)
            return None
        return entry

    def _ignore(self, key: str, exc: Exception) -> None:
        warnings.warn(f"sublinear: ignoring unusable plan cache entry {self.folder / f'{key}.json'}: {exc}; it will "
                      "be replaced", stacklevel=4)

    def store(self, key: str, entry: dict) -> None:
        folder = self.folder
        if folder is None:
            return
        try:
            write_json(folder / f"{key}.json", {**entry, "format": _FORMAT, "key": key})
        except OSError as exc:
            warnings.warn(f"sublinear: could not write the plan cache in {folder}: {exc}", stacklevel=3)


def write_json(path: Path, value: object) -> None:
    """Write ``value`` as JSON to ``path`` atomically: a temporary file in the same folder, renamed into place, so a
    reader never sees a partial file and an interrupted write leaves none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
