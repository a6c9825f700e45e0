"""Compiled execution: the training step as inductor compiles it, profiled from the joint graph AOTAutograd traces
(:mod:`.joint`, :mod:`.profile`) and run with the plan as AOTAutograd's partition (:mod:`.executor`)."""

from sublinear.execute.compiled.executor import (
    CompiledGraph, compile_plan, inductor_unavailable, recompute_tags, resolve_compiler,
)
from sublinear.execute.compiled.joint import JointGraph, JointTraceError, trace_joint
from sublinear.execute.compiled.profile import CompiledProfile, profile_joint

__all__ = ["CompiledGraph", "CompiledProfile", "JointGraph", "JointTraceError", "compile_plan", "compiled_profile",
           "inductor_unavailable", "profile_joint", "recompute_tags", "resolve_compiler", "trace_joint"]


def compiled_profile(graph, values, uses=None, rates=None) -> CompiledProfile:
    """The profile of ``graph``'s training step on ``values`` as inductor compiles it."""
    return profile_joint(trace_joint(graph, values), graph, uses, rates)
