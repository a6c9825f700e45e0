"""Storage-level memory accounting through a TorchDispatchMode.

Every tensor an aten op returns is resolved to its untyped storage. A storage is counted once, when it is
first seen, and released when its last reference dies (a weakref finalizer on the storage object, which
PyTorch keeps unique per storage). Views and in-place results therefore alias their base: memory is per
storage, never per tensor.

An operator whose kernel is Python (sublinear's own, registered with :func:`count_inside`) allocates inside its call
what a mode cannot see, since a mode sees the operator, not the calls its kernel makes: the tracker runs such an
operator's implementation under itself instead, so its temporaries count, on every device, meta included (where the
operator's registered meta kernel allocates only its results).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from sublinear.tensors import size_hint

__all__ = ["COUNTED_INSIDE", "StorageTracker", "count_inside", "inside_peak", "storages_of"]

COUNTED_INSIDE: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def count_inside(op: torch._ops.OpOverload, implementation: Callable[..., Any]) -> None:
    """Have every tracker run ``implementation`` (which computes what ``op`` does, with the same allocations) in
    place of ``op``, counting the storages its calls allocate."""
    COUNTED_INSIDE[op] = implementation


def inside_peak(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> int:
    """The most bytes ``op(*args, **kwargs)`` holds at once inside its call beyond its results, run on meta copies
    of its tensor arguments (any device's arguments, no memory): exact for an operator registered with
    :func:`count_inside`, whose allocations are its Python code's."""
    def on_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided([size_hint(n) for n in value.shape], [size_hint(n) for n in value.stride()],
                                       dtype=value.dtype, device="meta")
        return size_hint(value) if isinstance(value, torch.SymInt) else value

    args, kwargs = tree_map(on_meta, (tuple(args), dict(kwargs or {})))
    tracker = StorageTracker()
    tracker.track(tree_leaves((args, kwargs)))  # the arguments' storages (and views of them) are not the call's
    before = tracker.live_bytes
    with tracker:
        out = op(*args, **kwargs)
    return max(0, tracker.peak_bytes - before - sum(st.nbytes() for st in storages_of(out)))


def storages_of(value: Any) -> list[torch.UntypedStorage]:
    """Distinct untyped storages behind the tensors in a (nested) value.

    Plain and fake tensors own their storage; traceable wrapper subclasses (DTensor) are searched through their
    inner tensors.
    """
    seen: dict[int, torch.UntypedStorage] = {}
    pending = [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    while pending:
        t = pending.pop()
        if is_traceable_wrapper_subclass(t):
            pending.extend(getattr(t, name) for name in t.__tensor_flatten__()[0]
                           if isinstance(getattr(t, name), torch.Tensor))
        elif _owns_storage(t):
            st = t.untyped_storage()
            seen.setdefault(st._cdata, st)
    return list(seen.values())


def _owns_storage(t: torch.Tensor) -> bool:
    dispatch = type(t).__torch_dispatch__
    return dispatch is torch.Tensor.__torch_dispatch__ or isinstance(t, FakeTensor)


EventListener = Callable[[str, int, int], None]


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages returned by aten ops inside the mode.

    ``live_bytes``/``peak_bytes`` include storages registered with :meth:`track` (pre-existing tensors such as
    parameters). ``listener(kind, key, nbytes)`` is called with ``kind`` in {"alloc", "free"} for every change.
    Subclasses may override :meth:`on_op` to inspect each aten call.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """TorchDynamo compiles under the tracker, which sees the compiled artifact's operators at run time (all
        of them, for sublinear's backend, which runs the graph's operators one by one)."""
        return True

    def __init__(self, listener: EventListener | None = None) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.listener = listener
        self._finalizers: dict[int, weakref.finalize] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        """Count storages that already exist (parameters, inputs) as live."""
        for st in storages_of(list(tensors)):
            self._register(st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inside = COUNTED_INSIDE.get(func)
        if inside is not None:  # entered again for the implementation's calls, not left as the step ends: leaving
            TorchDispatchMode.__enter__(self)  # through __exit__ would stop watching every live storage
            try:
                return inside(*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        out = func(*args, **kwargs)
        for st in storages_of(out):
            self._register(st)
        self.on_op(func, args, kwargs, out)
        return out

    def on_op(self, func, args, kwargs, out) -> None:
        """Hook for subclasses; called after each aten op, once its outputs are registered."""

    def _register(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        nbytes = st.nbytes()
        if key in self.live:
            return
        self.live[key] = nbytes
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        self._finalizers[key] = weakref.finalize(st, self._release, key)
        if self.listener is not None:
            self.listener("alloc", key, nbytes)

    def _release(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        self._finalizers.pop(key, None)
        if nbytes is None:
            return
        self.live_bytes -= nbytes
        if self.listener is not None:
            self.listener("free", key, nbytes)

    def __exit__(self, *exc):
        # Storages still alive stop being watched: later frees must not call into a finished tracker.
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)
