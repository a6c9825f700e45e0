"""Compiled execution: a plan run as AOTAutograd's partition, forward and backward compiled by inductor
(:mod:`.executor`), and the memory of what inductor compiled, read back from its wrappers (:mod:`.step_memory`)."""

from sublinear.execute.compiled.executor import (
    CompiledGraph, compile_plan, inductor_unavailable, recompute_tags, resolve_compiler,
)
from sublinear.execute.compiled.step_memory import CompiledStepMemory, compiled_step_memory
from sublinear.execute.compiled.toolchain import start_isa_probe

__all__ = ["CompiledGraph", "CompiledStepMemory", "compile_plan", "compiled_step_memory", "inductor_unavailable",
           "recompute_tags", "resolve_compiler", "start_isa_probe"]
