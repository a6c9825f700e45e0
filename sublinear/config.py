"""``SublinearMemoryConfig``: the planner's knobs, named as in MegEngine, each MegEngine name with a clear alias."""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

__all__ = ["CLEAR_NAMES", "SublinearMemoryConfig", "parse_size"]


MAX_THRESH_NR_TRY = 1000
MAX_GENETIC_POOL_SIZE = 1000
MAX_GENETIC_NR_ITER = 10000
COST_MODELS = ("auto", "measure", "estimate", "reference")
COMPILERS = ("auto", "inductor", "eager")


@dataclass(frozen=True)
class SublinearMemoryConfig:
    """Planner settings. Sizes are bytes (``lb_memory`` and ``memory_budget`` also take ``"11GiB"``-style text).

    The MegEngine names below each have a clear alias (:data:`CLEAR_NAMES`), accepted by the constructor and readable
    as a property: ``SublinearMemoryConfig(genetic_generations=20).genetic_nr_iter == 20``. ``dataclasses.replace``
    takes the MegEngine names.

    thresh_nr_try (``grid_tries``): grid points per phase of the threshold grid search (0..1000).
    genetic_nr_iter (``genetic_generations``): generations of the genetic refinement; 0 turns it off (0..10000).
    genetic_pool_size (``genetic_population``): survivors per generation (1..1000; >= 2 when the genetic search runs).
    lb_memory (``memory_floor``): floor; a plan below it keeps expensive ops until it reaches the floor (>= 0).
    num_worker (``scoring_processes``): processes that score genetic candidates; None means max(1, cpu_count // 2).
    memory_budget: the plan is the least predicted step time whose predicted peak fits this many bytes.
        "auto" (default): the device's free memory at planning time less ``memory_headroom`` on CUDA, and no
        budget on CPU and meta. None: no budget; the plan is then the lowest peak within ``max_time_ratio``.
    memory_headroom: fraction of the free device memory an "auto" budget leaves for allocator fragmentation.
    max_time_ratio: no plan's predicted step time exceeds this multiple of eager's (>= 1.0).
    min_memory_per_time: with no budget, the least memory a plan must buy for its time: along the front of the plans
        found, from eager towards the lowest peak, a plan is taken only where it saves at least this fraction of
        eager's peak per unit of step-time ratio it adds over the plan before it (1.0, the default: 1 % of the peak
        for each 1 % of step time), and a plan that saves under 5 % of eager's peak runs as eager. 0: the lowest
        peak within ``max_time_ratio`` (MegEngine's fitness). Ignored under a memory budget.
    planners: planners run in order (names registered in :data:`sublinear.planners.PLANNERS`; a name that is not
        registered is refused when a plan is made, where the registry is complete).
    cost_model: op times "measure"d on the device, "estimate"d from FLOPs and bytes moved over the device's rates
        (meta: a reference GPU's), estimated for the "reference" GPU whatever the device, or "auto" (default): the
        estimate, which gives the same plan in every process (measured times vary from run to run).
    seed: seed of the genetic and local searches; the same seed gives the same plan.
    compiler: what runs each planned graph. "inductor": AOTAutograd partitions the graph as the plan says and
        inductor compiles forward and backward (recompute included); "eager": sublinear's own executor runs the
        graph op by op on eager kernels (for debugging: exact like eager, slower); "auto" (default):
        $SUBLINEAR_COMPILER when set, else inductor where it can compile for the device (CPU: a C++ compiler;
        CUDA: triton), else eager.
    cache_dir: plan cache folder; None uses $SUBLINEAR_CACHE_DIR or the user cache dir; "" disables it.
    chunk_lm_heads: an LM head (a linear to a vocabulary larger than its input) and its cross-entropy are computed in
        chunks of tokens, never holding the logits' log-softmax or gradient whole (``sublinear.capture.lm_head``);
        equal to the unchunked loss and gradients to float rounding, not bit for bit. None (default): on where
        inductor runs the graph and when planning on the meta device, off on sublinear's eager executor (which trains
        bit for bit like eager); True or False: on or off everywhere.
    fuse_attention: attention written out as its matrices (a product of queries and keys, its softmax, a product
        with the values: Hugging Face's ``attn_implementation="eager"``) is computed by
        ``F.scaled_dot_product_attention``, never holding heads x queries x keys values
        (``sublinear.capture.attention``; a site whose dropout draws random numbers, whose probabilities are read
        elsewhere or whose operands differ in dtype is left alone); equal to float rounding, not bit for bit.
        None (default): on where inductor runs the graph and when planning on the meta device, off on sublinear's
        eager executor; True or False: on or off everywhere.
    channels_last: how inductor lays out convolutions. True: as it chooses (on the CPU with oneDNN, channels-last
        for every graph with a convolution: each activation and weight a convolution reads in another layout is
        copied, and forward keeps the copies backward reads); False: in the layouts traced (inductor's
        ``layout_optimization`` off); None (default): inductor's choice unless the layouts traced predict a lower peak
        for the unplanned step, and then, under a ``memory_budget``, still inductor's (made for speed) wherever a plan
        in it meets the budget, the layouts traced where none does; without a budget, the layouts traced. Both
        layouts compute the same values; the time model does not see which layout's kernels are faster.
    max_sizes: the largest shape of the forward's tensor arguments, by argument name (``{"input_ids": (32, 512)}``;
        None for a dimension left to TorchDynamo). Every dimension of the arguments is then dynamic from the first
        call, and the one plan is made for these sizes, so it serves every smaller shape. Without it a size that
        changes is planned for its power-of-two bucket of the largest value seen (see ``sublinear.capture.shapes``).
    """

    thresh_nr_try: int = 10
    genetic_nr_iter: int = 0
    genetic_pool_size: int = 20
    lb_memory: int = 0
    num_worker: int | None = None
    memory_budget: int | str | None = "auto"
    memory_headroom: float = 0.1
    max_time_ratio: float = 1.35
    min_memory_per_time: float = 1.0
    planners: tuple[str, ...] = ("grid", "mincut", "optimal", "genetic", "local")
    cost_model: str = "auto"
    seed: int = 0
    compiler: str = "auto"
    cache_dir: str | None = None
    chunk_lm_heads: bool | None = None
    fuse_attention: bool | None = None
    channels_last: bool | None = None
    max_sizes: Mapping[str, Sequence[int | None]] | None = None

    def __post_init__(self) -> None:
        for name in ("lb_memory", "memory_budget"):
            value = getattr(self, name)
            if isinstance(value, str) and not (name == "memory_budget" and value == "auto"):
                try:
                    object.__setattr__(self, name, parse_size(value))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc} (or \"auto\" for the device's free memory)"
                                     if name == "memory_budget" else f"{name}: {exc}") from None
        _int_in("thresh_nr_try", self.thresh_nr_try, 0, MAX_THRESH_NR_TRY)
        _int_in("genetic_nr_iter", self.genetic_nr_iter, 0, MAX_GENETIC_NR_ITER)
        _int_in("genetic_pool_size", self.genetic_pool_size, 1, MAX_GENETIC_POOL_SIZE)
        if self.genetic_nr_iter > 0 and self.genetic_pool_size < 2:
            raise ValueError(f"genetic_pool_size must be >= 2 when genetic_nr_iter > 0 (crossover needs two "
                             f"parents); got {self.genetic_pool_size}")
        _int_at_least("lb_memory", self.lb_memory, 0)
        if self.num_worker is not None:
            _int_at_least("num_worker", self.num_worker, 1, "or None")
        if self.memory_budget is not None and self.memory_budget != "auto":
            _int_at_least("memory_budget", self.memory_budget, 1, "(bytes), \"auto\" or None")
        if isinstance(self.memory_headroom, bool) or not isinstance(self.memory_headroom, (int, float)) \
                or not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom must be a fraction in [0, 1); got {self.memory_headroom!r}")
        if isinstance(self.max_time_ratio, bool) or not isinstance(self.max_time_ratio, (int, float)) \
                or not self.max_time_ratio >= 1.0:
            raise ValueError(f"max_time_ratio must be a number >= 1.0 (1.0: never slower than eager; "
                             f"math.inf: no cap); got {self.max_time_ratio!r}")
        if isinstance(self.min_memory_per_time, bool) or not isinstance(self.min_memory_per_time, (int, float)) \
                or not 0 <= self.min_memory_per_time < math.inf:
            raise ValueError(f"min_memory_per_time must be a number >= 0 (0: the lowest peak within max_time_ratio); "
                             f"got {self.min_memory_per_time!r}")
        if isinstance(self.planners, str) or not isinstance(self.planners, (tuple, list)):
            raise ValueError(f"planners must be a tuple of planner names; got {self.planners!r}")
        object.__setattr__(self, "planners", tuple(self.planners))
        if not all(isinstance(p, str) for p in self.planners):
            raise ValueError(f"planners must be planner names (str); got {self.planners!r}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}; got {self.cost_model!r}")
        _int_at_least("seed", self.seed, 0)
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}; got {self.compiler!r}")
        for name in ("chunk_lm_heads", "fuse_attention"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None (on where inductor runs the graph); "
                                 f"got {getattr(self, name)!r}")
        if self.channels_last is not None and not isinstance(self.channels_last, bool):
            raise ValueError(f"channels_last must be True (inductor's layout), False (the layouts traced) or None "
                             f"(the one of lower predicted peak); got {self.channels_last!r}")
        if self.max_sizes is not None:
            object.__setattr__(self, "max_sizes", _max_sizes(self.max_sizes))
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir must be a path, '' (no cache) or None; got {type(self.cache_dir).__name__}")

    grid_tries = property(lambda self: self.thresh_nr_try, doc="``thresh_nr_try``, by its clear name.")
    genetic_generations = property(lambda self: self.genetic_nr_iter, doc="``genetic_nr_iter``, by its clear name.")
    genetic_population = property(lambda self: self.genetic_pool_size, doc="``genetic_pool_size``, by its clear name.")
    memory_floor = property(lambda self: self.lb_memory, doc="``lb_memory``, by its clear name.")
    scoring_processes = property(lambda self: self.num_worker, doc="``num_worker``, by its clear name.")

    @property
    def workers(self) -> int:
        """Scoring processes actually used."""
        return self.num_worker if self.num_worker is not None else max(1, (os.cpu_count() or 1) // 2)

    def planning_key(self) -> dict:
        """Fields that change the plan (for cache keys): everything but where the cache lives and worker count."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cache_dir", "num_worker")}


CLEAR_NAMES = {"grid_tries": "thresh_nr_try", "genetic_generations": "genetic_nr_iter",
               "genetic_population": "genetic_pool_size", "memory_floor": "lb_memory",
               "scoring_processes": "num_worker"}  # clear alias -> MegEngine's name


def _accepting_clear_names(init):
    """The dataclass constructor, taking each MegEngine-named field by its clear alias too; errors name a value
    by the name it was given."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = {}
        for clear, megengine in CLEAR_NAMES.items():
            if clear in kwargs:
                if megengine in kwargs:
                    raise TypeError(f"SublinearMemoryConfig got {clear} and {megengine}, two names for one setting; "
                                    "give one")
                kwargs[megengine] = kwargs.pop(clear)
                given[megengine] = clear
        try:
            init(self, *args, **kwargs)
        except ValueError as exc:
            message = str(exc)
            for megengine, clear in given.items():
                if message.startswith(megengine):
                    raise ValueError(f"{clear} ({megengine}){message[len(megengine):]}") from None
            raise

    return __init__


SublinearMemoryConfig.__init__ = _accepting_clear_names(SublinearMemoryConfig.__init__)


def _max_sizes(value: object) -> tuple[tuple[str, tuple[int | None, ...]], ...]:
    """``max_sizes`` as sorted (argument name, sizes) pairs, checked."""
    example = '(as in {"input_ids": (32, 512)}: argument name -> its largest size per dimension, None to leave one)'
    if not isinstance(value, Mapping):
        raise ValueError(f"max_sizes must be a mapping {example}; got {type(value).__name__}")
    checked = []
    for name, sizes in value.items():
        if not isinstance(name, str) or isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise ValueError(f"max_sizes[{name!r}] must be a sequence of sizes {example}; got {sizes!r}")
        for size in sizes:
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"max_sizes[{name!r}] holds {size!r}: each size is an integer >= 1 or None {example}")
        checked.append((name, tuple(sizes)))
    return tuple(sorted(checked))


def _int_in(name: str, value: object, low: int, high: int) -> None:
    _int_at_least(name, value, low)
    if value > high:
        raise ValueError(f"{name} must be <= {high}; got {value} (a search this size would run for hours)")


def _int_at_least(name: str, value: object, low: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {low}{' ' + extra if extra else ''}; "
                         f"got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}{' ' + extra if extra else ''}; got {value}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``11GiB`` (units of 2**30 bytes), ``500 MB`` (10**6), ``1.5 KiB``, ``4096`` or ``5e7``. A unit is
    a whole name, in any case: ``11G`` is refused, as it could mean GB or GiB. Fractions of a byte round down."""
    from fractions import Fraction  # exact: binary floating point reads "4.35 KB" one byte short

    match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,2})?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}; accepted: a number of bytes (50000000 or 5e7), or a number with a "
                         "unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), as in "
                         "\"11GiB\" or \"500 MB\"")
    value = math.floor(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return value
