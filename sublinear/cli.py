"""Command line: ``sublinear maxbatch | plan | profile`` (also ``python -m sublinear``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import re
import sys
from collections.abc import Sequence

import torch

from .config import SublinearMemoryConfig
from .models import MODELS, ModelSpec, get_model

__all__ = ["main", "parse_size"]

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


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _model(name: str) -> ModelSpec:
    if name in MODELS:
        return get_model(name)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import model factory {name!r}: {exc}") from None
        return ModelSpec(name, f"user model {name}", factory, _user_inputs, None)
    raise ValueError(f"unknown model {name!r}; built-in: {', '.join(MODELS)}, or package.module:callable")


_USER_INPUT: dict = {}


def _user_inputs(batch: int, *, device: str = "cpu", seq: int | None = None):
    shape, dtype = _USER_INPUT.get("shape"), _USER_INPUT.get("dtype", torch.float32)
    if shape is None:
        raise ValueError("a user model needs --input-shape (per sample, e.g. 3,224,224) or --seq")
    if dtype in (torch.int64, torch.int32):
        return (torch.zeros((batch, *shape), dtype=dtype, device=device),), {}
    return (torch.zeros((batch, *shape), dtype=dtype, device=device),), {}


def _cmd_maxbatch(args: argparse.Namespace) -> int:
    from .maxbatch import compare

    iters = tuple(int(v) for v in args.genetic_iters.split(",") if v != "")
    config = SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, seed=args.seed)
    for name in args.model.split(","):
        spec = _model(name)
        seq = args.seq if args.seq is not None else spec.default_seq
        rows = compare(spec, args.budget, iters, device=args.device, seq=seq, config=config,
                       baselines=not args.no_baselines, progress=lambda m: print(f"  {m}", file=sys.stderr))
        eager = next((r.max_batch for r in rows if r.strategy == "eager"), 0) or 1
        where = "meta device (simulated storages)" if args.device == "meta" else torch.cuda.get_device_name(0)
        print(f"\n{spec.name}{f' seq {seq}' if seq else ''}: max batch at {_mib(args.budget)} on {where}")
        print(f"{'strategy':34s} {'max batch':>9s} {'x eager':>8s} {'FLOPs':>7s} {'planning':>9s}")
        for r in rows:
            planning = f"{r.planning_seconds:8.2f}s" if r.planning_seconds is not None else f"{'-':>9s}"
            print(f"{r.strategy:34s} {r.max_batch:9d} {r.max_batch / eager:8.2f} {r.flops_ratio:7.3f} {planning}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .api import compile as sublinear_compile
    from .simulator import analyse

    spec = _model(args.model)
    seq = args.seq if args.seq is not None else spec.default_seq
    with torch.device("meta"):
        model = spec.build().train()
    example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
    config = SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, genetic_nr_iter=args.genetic_iters,
                                   seed=args.seed)
    compiled = sublinear_compile(model, example, kwargs, config=config)
    plan, profile = compiled.sublinear_plan, compiled.sublinear_profile
    print(f"{spec.name} batch {args.batch}{f' seq {seq}' if seq else ''}: {plan}")
    a = analyse(profile, plan.to_plan())
    for b, ops in enumerate(plan.to_plan().blocks()):
        first, last = profile.ops[ops[0]].name, profile.ops[ops[-1]].name
        kept = int(profile.storage_bytes[[s for s in range(len(profile.storage_bytes))
                                          if a.retained[s] and a.block_of[profile.storage_producer[s]] == b]].sum())
        recompute = sum(profile.ops[o].flops for o in a.closure[b])
        print(f"  block {b:3d}: ops {ops[0]:4d}-{ops[-1]:4d} ({first} .. {last}); kept {_mib(kept)}, "
              f"recompute {recompute / 1e9:.2f} GFLOP")
    print(f"predicted peak {_mib(plan.predicted_peak_bytes)} vs eager {_mib(plan.baseline_peak_bytes)}; "
          f"recompute {plan.recompute_flops / 1e9:.2f} GFLOP (step FLOPs x{plan.flops_ratio:.3f})")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from .profiler import profile
    from .tracer import capture

    for name in args.model.split(","):
        spec = _model(name)
        seq = args.seq if args.seq is not None else spec.default_seq
        with torch.device("meta"):
            model = spec.build().train()
        example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
        p = profile(capture(model, example, kwargs), example, kwargs)
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

    p = sub.add_parser("maxbatch", help="max batch at a budget: eager, hand-written checkpointing, sublinear")
    common(p, "resnet50,bert-base")
    p.add_argument("--budget", type=parse_size, default=parse_size("11GiB"))
    p.add_argument("--genetic-iters", default="0", help="comma separated genetic_nr_iter values")
    p.add_argument("--device", choices=("meta", "cuda"), default="meta")
    p.add_argument("--no-baselines", action="store_true")
    p.set_defaults(run=_cmd_maxbatch)

    p = sub.add_parser("plan", help="print the plan for one model and batch")
    common(p, "resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--genetic-iters", type=int, default=0)
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
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if args.input_shape:
        _USER_INPUT["shape"] = tuple(int(v) for v in args.input_shape.split(","))
    _USER_INPUT["dtype"] = getattr(torch, args.dtype)
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"sublinear: error: {exc}", file=sys.stderr)
        return 2
