"""On-disk plan cache: the search result for one graph, input signature and config, reused across processes.

Entries are JSON files named by a SHA-256 key of the captured graph's code, the example input signature, the
planning config and the library versions. Writes are atomic (a temporary file renamed into place), so an
interrupted planning run never leaves a half-written entry. A corrupt or mismatching entry is ignored with a
warning and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path

import torch

from .plan import Plan, PlanError

__all__ = ["PlanCache", "cache_dir"]

log = logging.getLogger("sublinear.cache")
_FORMAT = 2


def cache_dir(configured: str | os.PathLike | None) -> Path | None:
    """The cache folder: the config's, else $SUBLINEAR_CACHE_DIR, else the user cache dir; None when disabled."""
    if configured is not None:
        return Path(configured).expanduser() if str(configured) else None
    env = os.environ.get("SUBLINEAR_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sublinear"


class PlanCache:
    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    @staticmethod
    def key(graph_code: str, signature: str, config: dict, num_ops: int) -> str:
        from . import __version__

        text = json.dumps({"graph": graph_code, "inputs": signature, "config": config, "ops": num_ops,
                           "torch": torch.__version__, "sublinear": __version__, "format": _FORMAT},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str, num_ops: int) -> dict | None:
        """The stored entry, or None (missing, disabled, or unusable: then a warning says why)."""
        if self.folder is None:
            return None
        path = self.folder / f"{key}.json"
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("format") != _FORMAT or entry.get("key") != key or entry.get("num_ops") != num_ops:
                raise ValueError("entry does not belong to this graph")
            Plan.from_dict(entry).validate(num_ops)
        except (OSError, ValueError, KeyError, TypeError, PlanError) as exc:
            warnings.warn(f"sublinear: ignoring unusable plan cache entry {path}: {exc}", stacklevel=3)
            return None
        return entry

    def store(self, key: str, entry: dict) -> None:
        if self.folder is None:
            return
        entry = {**entry, "format": _FORMAT, "key": key}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f)
                os.replace(tmp, self.folder / f"{key}.json")
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            warnings.warn(f"sublinear: could not write the plan cache in {self.folder}: {exc}", stacklevel=3)
