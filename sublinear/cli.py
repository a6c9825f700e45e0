"""Command line: ``sublinear maxbatch | tune | plan | profile`` (also ``python -m sublinear``)."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Sequence

import torch

from .config import SublinearMemoryConfig, parse_size
from .models import MODELS, ModelSpec, get_model

__all__ = ["main"]

log = logging.getLogger("sublinear.cli")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _model(name: str, args: argparse.Namespace) -> ModelSpec:
    """A built-in model, or ``package.module:callable`` with inputs from ``--input-shape``/``--seq`` and
    ``--dtype``."""
    if name in MODELS:
        return get_model(name)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import model factory {name!r}: {exc}") from None
        shape = _int_list(args.input_shape, "--input-shape") if args.input_shape else None
        return ModelSpec(name, f"user model {name}", functools.partial(_build_user_model, factory, name),
                         functools.partial(_user_inputs, shape, _dtype(args.dtype)), None)
    raise ValueError(f"unknown model {name!r}; built-in: {', '.join(MODELS)}, or package.module:callable")


def _build_user_model(factory, name: str):
    """The user's model from its factory, or a one-line error saying what went wrong."""
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - any failure of the user's factory is reported in one line
        raise ValueError(f"--model {name}: calling the factory failed: {type(exc).__name__}: {exc} (it must build "
                         "the model with no arguments)") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {name}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype: not a torch dtype: {name!r} (e.g. float32, bfloat16, int64)")
    return dtype


def _user_inputs(shape: tuple[int, ...] | None, dtype: torch.dtype, batch: int, *, device: str = "cpu",
                 seq: int | None = None):
    if seq is not None:
        shape = (seq,)
    if shape is None:
        raise ValueError("a user model needs --input-shape (per sample, e.g. 3,224,224) or --seq")
    return (torch.zeros((batch, *shape), dtype=dtype, device=device),), {}


class _Progress:
    """``progress(done, total, message)`` for long runs: a bar redrawn in place on a terminal, log lines
    otherwise."""

    WIDTH = 24

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty()

    def __call__(self, done: int, total: int, message: str) -> None:
        if not self.bar:
            log.info(message)
            return
        filled = self.WIDTH * done // max(1, total)
        line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} {message}"
        self.stream.write(f"\r\033[K{line[:120]}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


def _cmd_maxbatch(args: argparse.Namespace) -> int:
    from .maxbatch import compare
    from .report import machine, maxbatch_markdown, maxbatch_text

    iters = _int_list(args.genetic_iters, "--genetic-iters")
    limits = tuple(_float(v, "--flops-limits") for v in args.flops_limits.split(",") if v)
    config = _measuring_config(args)
    autocast = _AUTOCAST[args.autocast]
    results = {}
    for name in args.model.split(","):
        spec = _model(name, args)
        seq = args.seq if args.seq is not None else spec.default_seq
        rows = compare(spec, args.budget, iters, device=args.device, seq=seq, config=config,
                       baselines=not args.no_baselines, progress=_Progress(), autocast=autocast,
                       flops_limits=limits)
        label = f"{spec.name}{f' seq {seq}' if seq else ''}{f' autocast {args.autocast}' if autocast else ''}"
        results[label] = rows
        print(f"\n{maxbatch_text(f'{label}: max batch at {_mib(args.budget)} on {machine(args.device)}', rows)}")
    _write(args.out, maxbatch_markdown(results, args.budget, machine(args.device), args.command_line))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from .maxbatch import tune
    from .report import plot_convergence, tuning_markdown

    iters = _int_list(args.genetic_iters, "--genetic-iters")
    config = _measuring_config(args)
    tunings = {}
    for name in args.model.split(","):
        spec = _model(name, args)
        tunings[spec.name] = tune(spec, iters, args.budget, config, progress=_Progress())
    text = tuning_markdown(tunings, args.budget, args.seed, args.command_line)
    print(text)
    _write(args.out, text)
    if args.plot:
        plot_convergence(tunings, args.plot)
    return 0


def _measuring_config(args: argparse.Namespace) -> SublinearMemoryConfig:
    """Planning time is one of the results: plans are searched afresh, never read from the plan cache."""
    return SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, seed=args.seed, num_worker=args.workers,
                                 cache_dir="")


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    numbers = [_float(v, flag) for v in text.split(",") if v.strip()]
    if not numbers or any(v < 0 or v != int(v) for v in numbers):
        raise ValueError(f"{flag} takes comma separated integers >= 0, e.g. 0,20; got {text!r}")
    return tuple(int(v) for v in numbers)


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag}: not a number: {text!r}") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from .api import compile as sublinear_compile
    from .planners import BudgetError

    spec = _model(args.model, args)
    seq = args.seq if args.seq is not None else spec.default_seq
    with torch.device("meta"):
        model = spec.build().train()
    example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
    config = SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, genetic_nr_iter=args.genetic_iters,
                                   seed=args.seed, num_worker=args.workers, memory_budget=args.memory_budget,
                                   lb_memory=args.lb_memory)
    try:
        compiled = sublinear_compile(model, example, kwargs, config=config)
    except BudgetError as exc:
        raise ValueError(str(exc)) from None
    plan = compiled.sublinear_plan
    if plan is None:
        raise ValueError(f"{spec.name} cannot be planned ahead on the meta device (see the log with -v)")
    print(f"{spec.name} batch {args.batch}{f' seq {seq}' if seq else ''}:")
    print(plan.describe())
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from .capture import capture
    from .profiler import profile

    for name in args.model.split(","):
        spec = _model(name, args)
        seq = args.seq if args.seq is not None else spec.default_seq
        with torch.device("meta"):
            model = spec.build().train()
        example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
        p = profile(capture(model, example, kwargs).graph)
        fixed = p.parameter_bytes + p.buffer_bytes + p.gradient_bytes
        print(f"{spec.name} batch {args.batch}: eager activations {_mib((p.measured_peak_bytes - fixed) / args.batch)} "
              f"per sample")
        print(p.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sublinear", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, default_model: str) -> None:
        p.add_argument("--model", default=default_model,
                       help="built-in name(s), comma separated, or package.module:callable")
        p.add_argument("--seq", type=int, default=None, help="sequence length for text models")
        p.add_argument("--input-shape", default=None, help="per-sample input shape for a user model, e.g. 3,224,224")
        p.add_argument("--dtype", default="float32", help="input dtype for a user model")
        p.add_argument("--thresh-nr-try", type=int, default=10)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--workers", type=int, default=1, help="processes scoring genetic candidates")

    p = sub.add_parser("maxbatch", help="max batch at a budget: eager, hand-written checkpointing, sublinear")
    common(p, "resnet50,bert-base")
    p.add_argument("--budget", type=parse_size, default=parse_size("11GiB"))
    p.add_argument("--genetic-iters", default="0,20", help="comma separated genetic_nr_iter values")
    p.add_argument("--flops-limits", default="",
                   help="comma separated step-FLOPs ratios: add the budget-driven planner limited to each")
    p.add_argument("--autocast", choices=tuple(_AUTOCAST), default="none", help="run every step under autocast")
    p.add_argument("--device", choices=("meta", "cuda"), default="meta")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--out", default=None, help="also write the table as markdown to this file")
    p.set_defaults(run=_cmd_maxbatch)

    p = sub.add_parser("tune", help="genetic-iteration sweep: best peak, max batch and planning time per value")
    common(p, "resnet50")
    p.add_argument("--budget", type=parse_size, default=parse_size("11GiB"))
    p.add_argument("--genetic-iters", default="0,1,2,5,10,20")
    p.add_argument("--out", default=None, help="also write the table as markdown to this file")
    p.add_argument("--plot", default=None, help="write the convergence plot (PNG; needs matplotlib)")
    p.set_defaults(run=_cmd_tune)

    p = sub.add_parser("plan", help="print the plan for one model and batch")
    common(p, "resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--genetic-iters", type=int, default=0)
    p.add_argument("--memory-budget", type=parse_size, default=None,
                   help="least recompute whose predicted peak fits this size")
    p.add_argument("--lb-memory", type=parse_size, default=0, help="hand memory below this floor back for speed")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("profile", help="profile summary: eager memory per sample and the largest tensors")
    common(p, "resnet50,bert-base")
    p.add_argument("--batch", type=int, default=8)
    p.set_defaults(run=_cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed a one-line error
        return int(exc.code or 0)
    args.command_line = "sublinear " + " ".join(sys.argv[1:] if argv is None else argv)  # for the markdown
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(min(logging.INFO, logging.getLogger().level))  # progress lines even without -v
    try:
        _dtype(args.dtype)
        return args.run(args)
    except ValueError as exc:
        print(f"sublinear: error: {exc}", file=sys.stderr)
        return 2
