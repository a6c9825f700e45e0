"""Graph breaks and capture errors: where TorchDynamo ended a graph and why, and TorchDynamo's or the model's own
errors turned into messages that name the user's file, line and reason (a model error leaves with the model's
traceback, as eager's would)."""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

__all__ = ["CaptureError", "GraphBreak", "ModelErrorsAsEager", "NeedsData", "capture_error", "eager_or_model_error",
           "graph_breaks", "model_error"]


class CaptureError(RuntimeError):
    """TorchDynamo could not capture the forward; the message names the file, line and reason."""


class NeedsData(CaptureError):
    """Code that runs eagerly between graphs needs tensor values, which a data-less capture does not have; such a
    model is planned at its first real call instead."""


@dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo ended a graph and ran code eagerly, and why."""

    location: str  # file:line
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@contextlib.contextmanager
def graph_breaks() -> Iterator[list[GraphBreak]]:
    """Collect the graph breaks Dynamo reports while the block runs (each distinct break once)."""
    from torch._dynamo.utils import graph_break_dup_warning_checker

    found: list[GraphBreak] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            where = re.search(r"Graph break in user code at (\S+)", text)
            if where:
                found.append(GraphBreak(where.group(1), _break_reason(text)))

    loggers = [torch._logging.getArtifactLogger(name, "graph_breaks")
               for name in ("torch._dynamo.symbolic_convert", "torch._dynamo.convert_frame")]
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers), lg.disabled) for lg in loggers]
    handler = _Collect()
    graph_break_dup_warning_checker.reset()
    for lg in loggers:
        lg.handlers = [handler]
        lg.propagate = False
        lg.disabled = False
        lg.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        for lg, level, propagate, handlers, disabled in saved:
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers = handlers
            lg.disabled = disabled
        unique = list(dict.fromkeys(found))
        found[:] = unique


def _break_reason(text: str) -> str:
    """The most specific line of Dynamo's graph-break message: its explanation, else its stated reason."""
    explanation = re.search(r"Explanation: ([^\n]*)", text)
    if explanation:
        return explanation.group(1).strip()
    reason = re.search(r"Graph Break Reason: ([^\n]*)", text)
    return reason.group(1).strip() if reason else "unknown"


def capture_error(exc: BaseException, what: str) -> CaptureError:
    """A :class:`CaptureError` naming the user's file and line for an exception Dynamo raised."""
    frames = getattr(exc, "real_stack", None) or []
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if not where:
        match = re.findall(r'File "([^"]+)", line (\d+)', str(exc))
        user = [m for m in match if "/torch/" not in m[0]]
        if user:
            where = f"{user[-1][0]}:{user[-1][1]}"
    if not where:
        tb = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename
              and "/sublinear/" not in f.filename]
        where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) and exc.__cause__ is not None:
        inner = exc.__cause__  # sublinear's own backend failed on the captured graph
        reason = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        return CaptureError(f"sublinear could not take the graph TorchDynamo captured from {what}: "
                            f"{type(inner).__name__}: {reason} (a fault of sublinear's: please report it with this "
                            "message)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        return NeedsData(f"{what}{f' at {where}' if where else ''} needs tensor values ({type(exc).__name__}: "
                         f"{first}) in code TorchDynamo runs eagerly between graphs; a data-less capture cannot run "
                         "it, so the model is planned at its first training call, on real inputs.")
    if "device='meta'" in str(exc) and "convert all Tensors to FakeTensors" in str(exc):
        # torch.tensor(data, device="meta") builds an empty meta tensor without the dispatcher, so TorchDynamo's
        # fake tensor mode never sees it: plain torch.compile fails on such code as well.
        return CaptureError(f"TorchDynamo could not capture {what}{f' at {where}' if where else ''} on the meta "
                            "device: a tensor made there from data (torch.tensor(..., device='meta'), as "
                            "transformers' DynamicCache makes its empty KV cache) escapes TorchDynamo's fake tensors "
                            "(plain torch.compile fails the same way). Turn that code off when planning on meta "
                            "(Hugging Face models: config.use_cache = False, as training does), or plan on CPU or "
                            "CUDA tensors")
    return CaptureError(f"TorchDynamo could not capture {what}{f' at {where}' if where else ''}: "
                        f"{type(exc).__name__}: {first}. Make that code traceable (or move it out of forward); "
                        "sublinear plans only what TorchDynamo captures.")


def eager_or_model_error(forward: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run ``forward`` eagerly, as the user's code would, after TorchDynamo failed on it, and return its output.
    When eager fails too, the failure is the model's own: its exception is raised as eager raises it (same type and
    message), and :class:`ModelErrorsAsEager` around the caller gives it the model's frames only (no TorchDynamo
    or dispatch frames). Data-less stand-ins that cannot run code reading tensor values give None. Only for a call
    whose capture ran nothing yet: TorchDynamo applies a graph's side effects once the graph runs, so nothing of
    the model's happens twice."""
    try:
        return forward(*args, **kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException):
        return None
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, raised as it is
        exc._sublinear_model_traceback = _model_frames(exc.__traceback__)
        raise


def model_error(exc: BaseException) -> BaseException | None:
    """``exc`` with the model's own traceback when it is an error of the user's model (see
    :func:`eager_or_model_error`), for the caller to raise ``from None``; None for any other exception."""
    frames = getattr(exc, "_sublinear_model_traceback", None)
    if frames is None:
        return None
    del exc._sublinear_model_traceback
    return exc.with_traceback(frames)


class ModelErrorsAsEager:
    """Inside, an error of the user's model (see :func:`eager_or_model_error`) leaves with the model's traceback."""

    def __enter__(self) -> ModelErrorsAsEager:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: types.TracebackType | None) -> bool:
        error = model_error(exc) if exc is not None else None
        if error is not None:
            raise error from None
        return False


_DISPATCH_FILES = re.compile(r"torch/(_subclasses|_ops\.py|_compile\.py|_dynamo|utils/_stats\.py|_prims|_refs|_decomp)")


def _model_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from the model's call on: without sublinear's own outer frames, nor the innermost frames inside
    torch's dispatch machinery (fake tensors, op overloads), so the error ends where eager's does."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    while len(frames) > 1 and re.search(r"/sublinear/|torch/nn/modules/module\.py",
                                        frames[0].tb_frame.f_code.co_filename.replace("\\", "/")):
        frames.pop(0)  # sublinear's call of the model, and the module-call frames the user's own call shows
    while len(frames) > 1 and _DISPATCH_FILES.search(frames[-1].tb_frame.f_code.co_filename.replace("\\", "/")):
        frames.pop()
    trimmed = None
    for frame in reversed(frames):
        trimmed = types.TracebackType(trimmed, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return trimmed
