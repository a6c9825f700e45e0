"""Command line: ``sublinear maxbatch | tune | plan | profile`` (also ``python -m sublinear``).

Every bad value gives one line on stderr, ``sublinear <command>: error: ...``, and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence

import torch

from sublinear import __version__
from sublinear.config import SublinearMemoryConfig, parse_size
from sublinear.core.profile import profile_summary
from sublinear.core.units import format_bytes
from sublinear.models import MODELS, ModelSpec, get_model

__all__ = ["main"]

log = logging.getLogger("sublinear.tools.cli")

DESCRIPTION = ("Plan activation checkpointing for PyTorch training: how large a batch fits (maxbatch), how many "
               "genetic generations pay off (tune), the plan for one batch (plan), and eager memory (profile). "
               "Models run on the meta device: nothing is allocated and nothing is downloaded.")
HF_OPTIONS = ("layers", "hidden", "attn")


def _models_epilog() -> str:
    """The --model forms, one per line, wrapped to 100 columns."""
    forms = {name: spec.description for name, spec in MODELS.items()}
    forms["hf:<ModelClass>"] = ("a transformers model class from its default config, random init, nothing "
                                "downloaded (e.g. hf:BertForSequenceClassification, hf:GPT2LMHeadModel, "
                                "hf:LlamaForCausalLM, hf:T5ForConditionalGeneration, hf:ViTForImageClassification); "
                                "sized with --layers, --hidden, --attn")
    forms["pkg.module:fn"] = ("fn() builds the model (importable from the current directory); its input is "
                              "zeros of --input-shape per sample (or of length --seq), of --dtype")
    width = max(map(len, forms))
    lines = ["models (--model):"]
    for name, text in forms.items():
        lines += textwrap.wrap(text, 100, initial_indent=f"  {name:{width}s}  ", subsequent_indent=" " * (width + 4))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Option values: argparse types that name the problem in one line


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    return parse


def _int_list(least: int, example: str) -> Callable[[str], tuple[int, ...]]:
    """Comma separated integers >= ``least``."""
    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or not all(p.isdigit() and int(p) >= least for p in parts):
            raise argparse.ArgumentTypeError(f"takes comma separated integers >= {least}, e.g. {example}; "
                                             f"got {text!r}")
        return tuple(int(p) for p in parts)
    return parse


def _time_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"takes a step-time ratio >= 1 (or inf), e.g. 1.35; got {text!r}")
    return value


def _time_ratios(text: str) -> tuple[float, ...]:
    return tuple(_time_ratio(v) for v in text.split(",") if v.strip())


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _output_file(path: str) -> str:
    """A file the command writes when its work is done: checked now, so that a typo costs no run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {path}: permission denied")
    return path


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"not a torch dtype: {name!r} (e.g. float32, bfloat16, int64)")
    return dtype


# ---------------------------------------------------------------------------------------------------------------
# Models


def _model(name: str, args: argparse.Namespace) -> ModelSpec:
    """A built-in model, ``hf:<ModelClass>``, or ``package.module:callable``; built once on meta here (a user's
    model also runs its forward once), so that a model that cannot be built, or cannot take the inputs made for it,
    fails now, in one line."""
    if name.startswith("hf:"):
        from sublinear.models.hf import hf_model

        spec = hf_model(name[len("hf:"):], layers=args.layers, hidden=args.hidden, attn=args.attn or "eager")
    else:
        given = [f"--{option}" for option in HF_OPTIONS if getattr(args, option) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: for hf:<ModelClass> models only, not {name!r}")
        if name in MODELS:
            return get_model(name)
        if ":" not in name:
            raise ValueError(f"unknown model {name!r}; built-in: {', '.join(MODELS)}, or hf:<ModelClass>, or "
                             "package.module:callable")
        spec = _user_model(name, args)
        _check_user_forward(spec, args)
        return spec
    with torch.device("meta"):
        spec.build()
    return spec


# Errors of a forward that reads its input as indices (an embedding, indexing, one_hot) and got floats.
_FLOAT_INDICES = re.compile(r"'indices' to have one of the following scalar types|used as indices must be|"
                            r"only applicable to index tensor|Expected dtype int32 or int64 for index")


def _check_user_forward(spec: ModelSpec, args: argparse.Namespace) -> None:
    """Run the user's model forward once, data-less, on the inputs every command makes for it (at batch 2: training
    BatchNorm refuses one sample), so that a forward that cannot take them fails now, in one line."""
    with torch.device("meta"):
        model = spec.build().train()
        example, kwargs = spec.example_inputs(2, device="meta", seq=_seq(args, spec))
        try:
            model(*example, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the user's forward is reported in one line
            given = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in example)
            hint = ("it reads its input as indices (token ids): pass --dtype int64"
                    if args.dtype.is_floating_point and _FLOAT_INDICES.search(str(exc))
                    else "check --input-shape, --seq and --dtype")
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}" if str(exc).strip() else \
                type(exc).__name__
            raise ValueError(f"--model {spec.name}: the forward fails on zeros of shape {given}: {why}; {hint}") \
                from None


def _user_model(name: str, args: argparse.Namespace) -> ModelSpec:
    """``package.module:callable``, imported with the current directory on ``sys.path`` (as ``python -m`` has)."""
    module_name, _, attr = name.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - the user's module may fail in any way while it is imported
        raise ValueError(f"cannot import model factory {name!r}: {type(exc).__name__}: {exc}") from None
    if not callable(factory):
        raise ValueError(f"--model {name}: {attr} is a {type(factory).__name__}, not a callable")
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise ValueError(f"--model {name}: the factory must build the model with no arguments ({exc})") from None
    except ValueError:  # no signature to inspect (some builtins): calling it tells
        pass
    return ModelSpec(name, f"user model {name}", functools.partial(_build_user_model, factory, name),
                     functools.partial(_user_inputs, args.input_shape, args.dtype), None)


def _build_user_model(factory, name: str) -> torch.nn.Module:
    """The user's model from its factory, or a one-line error saying what went wrong."""
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - any failure of the user's factory is reported in one line
        raise ValueError(f"--model {name}: calling the factory failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {name}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _user_inputs(shape: tuple[int, ...] | None, dtype: torch.dtype, batch: int, *, device: str = "cpu",
                 seq: int | None = None):
    """``([batch, *shape],), {}`` zeros of ``dtype``, with ``shape`` = ``(seq,)`` when a sequence length is given."""
    if seq is not None:
        shape = (seq,)
    if shape is None:
        raise ValueError("a user model needs --input-shape (per sample, e.g. 3,224,224) or --seq")
    return (torch.zeros((batch, *shape), dtype=dtype, device=device),), {}


def _seq(args: argparse.Namespace, spec: ModelSpec) -> int | None:
    return args.seq if args.seq is not None else spec.default_seq


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


def _require_matplotlib(flag: str) -> None:
    """Checked before the work that the plot follows."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib (pip install 'sublinear[plot]')") from None


def _measuring_config(args: argparse.Namespace) -> SublinearMemoryConfig:
    """Planning time is one of the results: plans are searched afresh, never read from the plan cache."""
    return SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, seed=args.seed, num_worker=args.workers,
                                 max_time_ratio=args.max_time_ratio, cache_dir="")


# ---------------------------------------------------------------------------------------------------------------
# Commands


def _cmd_maxbatch(args: argparse.Namespace) -> int:
    from sublinear.tools.maxbatch import compare
    from sublinear.tools.report import machine, maxbatch_markdown, maxbatch_text

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to this torch")
    config = _measuring_config(args)
    autocast = _AUTOCAST[args.autocast]
    specs = [_model(name, args) for name in args.model.split(",")]
    results, notes = {}, []
    for spec in specs:
        seq = _seq(args, spec)
        skipped: list[str] = []
        rows = compare(spec, args.memory_budget, args.genetic_iters, device=args.device, seq=seq, config=config,
                       baselines=not args.no_baselines, progress=_Progress(), autocast=autocast,
                       time_limits=args.time_limits, note=skipped.append)
        label = f"{spec.name}{f' seq {seq}' if seq else ''}{f' autocast {args.autocast}' if autocast else ''}"
        results[label] = rows
        notes += skipped
        title = f"{label}: max batch at {format_bytes(args.memory_budget)} on {machine(args.device)}"
        print(f"\n{maxbatch_text(title, rows)}")
        for line in skipped:
            print(f"note: {line}")
    _write(args.out, maxbatch_markdown(results, args.memory_budget, machine(args.device), args.command_line, notes))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from sublinear.tools.maxbatch import tune
    from sublinear.tools.report import plot_convergence, tuning_markdown

    if args.plot:
        _require_matplotlib("--plot")
    config = _measuring_config(args)
    specs = [_model(name, args) for name in args.model.split(",")]
    tunings = {spec.name: tune(spec, args.genetic_iters, args.memory_budget, config, progress=_Progress(),
                               seq=_seq(args, spec)) for spec in specs}
    text = tuning_markdown(tunings, args.memory_budget, args.seed, args.command_line)
    print(text)
    _write(args.out, text)
    if args.plot:
        plot_convergence(tunings, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from sublinear.api import compile as sublinear_compile
    from sublinear.planners import BudgetError

    if args.plot:
        _require_matplotlib("--plot")
    spec = _model(args.model, args)
    seq = _seq(args, spec)
    with torch.device("meta"):
        model = spec.build().train()
    example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
    config = SublinearMemoryConfig(thresh_nr_try=args.thresh_nr_try, genetic_nr_iter=args.genetic_iters,
                                   seed=args.seed, num_worker=args.workers, memory_budget=args.memory_budget,
                                   lb_memory=args.lb_memory, max_time_ratio=args.max_time_ratio)
    try:
        compiled = sublinear_compile(model, example, kwargs, config=config)
    except BudgetError as exc:
        raise ValueError(str(exc)) from None
    plan = compiled.sublinear_plan
    if plan is None:
        raise ValueError(f"{spec.name} cannot be planned ahead on the meta device (see the log with -v)")
    print(f"{spec.name} batch {args.batch}{f' seq {seq}' if seq else ''}:")
    print(plan.describe())
    if args.plot:
        from sublinear.tools.report import plot_step_memory

        profile = compiled.sublinear_profile
        if profile is None:
            raise ValueError(f"--plot shows one graph, and TorchDynamo split {spec.name} into "
                             f"{len(plan.graphs)} graphs")
        plot_step_memory(profile, plan.to_plan(), args.plot,
                         title=f"{spec.name} batch {args.batch}{f' seq {seq}' if seq else ''}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from sublinear.capture.dynamo import capture
    from sublinear.profiling.graph import profile

    for spec in [_model(name, args) for name in args.model.split(",")]:
        seq = _seq(args, spec)
        with torch.device("meta"):
            model = spec.build().train()
        example, kwargs = spec.example_inputs(args.batch, device="meta", seq=seq)
        graphs = capture(model, example, kwargs).graphs
        for i, graph in enumerate(graphs):
            p = profile(graph)
            fixed = p.parameter_bytes + p.buffer_bytes + p.gradient_bytes
            where = f" graph {i} of {len(graphs)}" if len(graphs) > 1 else ""
            print(f"{spec.name} batch {args.batch}{where}: eager activations "
                  f"{format_bytes((p.measured_peak_bytes - fixed) / args.batch)} per sample")
            print(profile_summary(p))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parser


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _model_options(p: argparse.ArgumentParser, default_model: str) -> None:
    p.add_argument("--model", default=default_model, metavar="NAMES",
                   help="built-in name(s), comma separated, hf:<ModelClass> or pkg.module:fn (listed "
                        "below; default %(default)s)")
    p.add_argument("--seq", type=_int_at_least(1), default=None, metavar="N",
                   help="sequence length of text models (default: the model's)")
    p.add_argument("--input-shape", type=_int_list(1, "3,224,224"), default=None, metavar="DIMS",
                   help="per-sample input shape of a package.module:callable model, e.g. 3,224,224")
    p.add_argument("--dtype", type=_dtype, default=torch.float32, metavar="DTYPE",
                   help="input dtype of a package.module:callable model (default float32)")
    hf = p.add_argument_group("hf:<ModelClass> models")
    hf.add_argument("--layers", type=_int_at_least(1), default=None, metavar="N",
                    help="number of layers (num_hidden_layers, n_layer or num_layers; default: the config's)")
    hf.add_argument("--hidden", type=_int_at_least(1), default=None, metavar="N",
                    help="hidden size; the intermediate size keeps its ratio to it and the head count divides it")
    hf.add_argument("--attn", choices=("eager", "sdpa"), default=None,
                    help="attn_implementation (default eager)")


def _planner_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thresh-nr-try", type=_int_at_least(0), default=10, metavar="N",
                   help="grid points per phase of the threshold grid search (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the genetic search (default %(default)s)")
    p.add_argument("--workers", type=_int_at_least(1), default=1, metavar="N",
                   help="processes scoring genetic candidates (default %(default)s)")
    p.add_argument("--max-time-ratio", type=_time_ratio, default=SublinearMemoryConfig.max_time_ratio, metavar="R",
                   help="no plan's predicted step time exceeds R times eager's (default %(default)s; inf: no cap)")


def _budget_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", type=_size, default=parse_size("11GiB"), metavar="SIZE",
                   help="device memory to fit in, e.g. 11GiB, 500MB or bytes (default 11GiB)")
    p.add_argument("--budget", type=_size, dest="memory_budget", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    epilog = _models_epilog()
    parser = _Parser(prog="sublinear", description=textwrap.fill(DESCRIPTION, 100), epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sublinear {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{maxbatch,tune,plan,profile}")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary, epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("maxbatch", "max batch within a memory budget: eager, hand-written checkpointing, sublinear")
    _model_options(p, "resnet50,bert-base")
    _budget_option(p)
    _planner_options(p)
    p.add_argument("--genetic-iters", type=_int_list(0, "0,20"), default=(0, 20), metavar="LIST",
                   help="comma separated genetic_nr_iter values, one sublinear row each (default 0,20)")
    p.add_argument("--time-limits", type=_time_ratios, default=(), metavar="LIST",
                   help="comma separated step-time caps (e.g. 1.2,1.5,inf): one more sublinear row each, with the "
                        "largest --genetic-iters value")
    p.add_argument("--autocast", choices=tuple(_AUTOCAST), default="none", help="run every step under autocast")
    p.add_argument("--device", choices=("meta", "cuda"), default="meta",
                   help="meta: measured without memory; cuda: every candidate batch really runs (default meta)")
    p.add_argument("--no-baselines", action="store_true", help="leave out the hand-written checkpointing rows")
    p.add_argument("--out", type=_output_file, default=None, metavar="FILE",
                   help="also write the table as markdown to this file")
    p.set_defaults(run=_cmd_maxbatch)

    p = command("tune", "genetic-iteration sweep: best peak, max batch and planning time per value")
    _model_options(p, "resnet50")
    _budget_option(p)
    _planner_options(p)
    p.add_argument("--genetic-iters", type=_int_list(0, "0,1,2,5"), default=(0, 1, 2, 5, 10, 20), metavar="LIST",
                   help="comma separated genetic_nr_iter values (default 0,1,2,5,10,20)")
    p.add_argument("--out", type=_output_file, default=None, metavar="FILE",
                   help="also write the table as markdown to this file")
    p.add_argument("--plot", type=_output_file, default=None, metavar="PNG",
                   help="write the convergence plot to this PNG (needs matplotlib)")
    p.set_defaults(run=_cmd_tune)

    p = command("plan", "the plan for one model and batch: blocks, retained bytes, predicted peak against eager")
    _model_options(p, "resnet50")
    p.add_argument("--batch", type=_int_at_least(1), default=32, metavar="N", help="batch size (default %(default)s)")
    p.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                   help="the least recompute whose predicted peak fits this size (default: the lowest peak)")
    p.add_argument("--lb-memory", type=_size, default=0, metavar="SIZE",
                   help="hand memory below this floor back for speed (keep expensive recomputed ops)")
    _planner_options(p)
    p.add_argument("--genetic-iters", type=_int_at_least(0), default=0, metavar="N",
                   help="generations of the genetic refinement (default 0: grid search only)")
    p.add_argument("--plot", type=_output_file, default=None, metavar="PNG",
                   help="write live memory over one training step, eager against the plan, to this PNG "
                        "(needs matplotlib)")
    p.set_defaults(run=_cmd_plan)

    p = command("profile", "eager memory per sample and the largest tensors")
    _model_options(p, "resnet50,bert-base")
    p.add_argument("--batch", type=_int_at_least(1), default=8, metavar="N", help="batch size (default %(default)s)")
    p.set_defaults(run=_cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from sublinear.capture.dynamo import CaptureError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a one-line error already printed
        return int(exc.code or 0)
    args.command_line = "sublinear " + " ".join(sys.argv[1:] if argv is None else argv)  # for the markdown
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(min(logging.INFO, logging.getLogger().level))  # progress lines even without -v
    try:
        return args.run(args)
    except (ValueError, CaptureError, OSError) as exc:
        print(f"sublinear {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
