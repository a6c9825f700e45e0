"""Scaled dot-product attention as plans see it, on every device they are made for.

- **FLOPs of CPU's fused kernel.** ``F.scaled_dot_product_attention`` on CPU (and on the fake CPU tensors a model on
  meta is captured as) runs ``aten._scaled_dot_product_flash_attention_for_cpu``, for which torch's flop counter has
  no formula: attention counted as free, and a plan could recompute it at no cost. Its forward and backward are
  counted here as torch counts the CUDA kernels (two products forward, four backward; a causal mask saves nothing),
  with grouped-query keys and values counted at the query's head count.
- **The fused kernel on meta.** Meta has no kernel choice of its own, so there the call takes PyTorch's math path,
  which holds the attention matrices (batch x heads x queries x keys, forward and backward): a model measured on
  meta held what no device runs, and not what its plan, captured on fake CPU tensors, modelled. Under
  :class:`FusedAttentionOnMeta` a call on meta tensors runs what CPU would choose for the same shapes, strides and
  arguments: the fused kernel (its result and log-sum-exp saved), with a boolean mask turned into an additive one as
  CPU does; the math path where CPU would take it (dropout).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["FusedAttentionOnMeta"]

_aten = torch.ops.aten
_CPU_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKEND = 1  # torch's SDPBackend.flash_attention, as aten._fused_sdp_choice returns it


def _heads_of_query(shape: torch.Size, heads: int) -> tuple[int, ...]:
    """A key or value shape with the query's head count: grouped-query attention computes every query head."""
    return (*shape[:-3], heads, *shape[-2:])


def _cpu_flash_flops(query_shape, key_shape, value_shape, *_args, out_shape=None, **_kwargs) -> int:
    heads = query_shape[-3]
    return sdpa_flop_count(query_shape, _heads_of_query(key_shape, heads), _heads_of_query(value_shape, heads))


def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *_args, out_shape=None,
                              **_kwargs) -> int:
    heads = query_shape[-3]
    return sdpa_backward_flop_count(grad_out_shape, query_shape, _heads_of_query(key_shape, heads),
                                    _heads_of_query(value_shape, heads))


for _op, _formula in ((_CPU_FLASH, _cpu_flash_flops),
                      (_aten._scaled_dot_product_flash_attention_for_cpu_backward, _cpu_flash_backward_flops)):
    if _op not in flop_registry:  # a later torch may count it itself
        register_flop_formula(_op)(_formula)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape, dtype and last-dimension stride, one row of memory: what CPU's kernel choice
    reads (shapes, the innermost stride, whether grad is required), never the values."""
    row = torch.empty((t.shape[-1] - 1) * t.stride(-1) + 1 if t.numel() else 0, dtype=t.dtype)
    strides = (0,) * (t.dim() - 1) + (t.stride(-1),)
    stand_in = row.as_strided(t.shape, strides)
    return stand_in.requires_grad_() if t.requires_grad and t.dtype.is_floating_point else stand_in


def _as_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``aten.scaled_dot_product_attention`` on meta tensors as CPU runs it: its kernel choice, then the fused
    kernel, or the math path (as meta runs it anyway) where CPU takes that."""
    with _disable_current_modes():
        choice = torch._fused_sdp_choice(*map(_stand_in, (query, key, value)),
                                         None if attn_mask is None else _stand_in(attn_mask), dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as CPU does, for every kernel
        allowed = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, allowed, torch.scalar_tensor(-math.inf, dtype=query.dtype,
                                                                        device=query.device))
    if choice != _FLASH_BACKEND:
        return _aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                        scale=scale, enable_gqa=enable_gqa)[0]
    return _CPU_FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class FusedAttentionOnMeta:
    """While one is entered, scaled dot-product attention on meta tensors runs as on CPU (module docstring), in
    every thread. The rule is a kernel registered with the dispatcher for autograd on meta, so it holds where a
    Python mode would not: in backward (whose recomputations, such as a checkpoint's, run outside the forward's
    function modes) and under TorchDynamo (which neither traces nor guards it)."""

    _lock = threading.Lock()
    _entered = 0
    _library: torch.library.Library | None = None

    def __enter__(self) -> FusedAttentionOnMeta:
        with self._lock:
            if FusedAttentionOnMeta._entered == 0:
                library = torch.library.Library("aten", "IMPL")
                library.impl("scaled_dot_product_attention", _as_on_cpu, "AutogradMeta")
                FusedAttentionOnMeta._library = library
            FusedAttentionOnMeta._entered += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            FusedAttentionOnMeta._entered -= 1
            if FusedAttentionOnMeta._entered == 0:
                FusedAttentionOnMeta._library._destroy()
                FusedAttentionOnMeta._library = None
