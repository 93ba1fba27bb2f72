"""Kernel backends behind the two passes, and the registry that picks one.

Dispatch walks ``_REGISTRY`` in priority order and takes the first backend
with no reasons against it; when none fits, the error lists every refusal.
A backend the user names is checked the same way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from twostage_mla.backends.base import AttentionBackend, AttentionSpec, CaptureLimits, State
from twostage_mla.backends.flash_attn import FlashAttn2Backend, FlashAttn3Backend
from twostage_mla.backends.flashinfer import FlashInferBackend
from twostage_mla.backends.reference import ReferenceBackend
from twostage_mla.backends.torch_efficient import TorchEfficientBackend
from twostage_mla.backends.torch_flash import TorchFlashBackend
from twostage_mla.state import MergeFn, merge_states

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "CaptureLimits",
    "MergeFn",
    "State",
    "backend_names",
    "refusals",
    "select_backend",
    "select_merge",
    "select_query_merge",
]

# Priority order: fastest first; the reference last, since it runs everywhere.
# FlashInfer leads: measured on H200 (docs/performance.md). FA3 and FA2 never ran
# here (no wheel), so they follow it; torch's own kernels need no extra package;
# torch_flash (FA2 in torch) beats torch_efficient where both fit (GQA).
_REGISTRY: list[type[AttentionBackend]] = [
    FlashInferBackend,
    FlashAttn3Backend,
    FlashAttn2Backend,
    TorchFlashBackend,
    TorchEfficientBackend,
    ReferenceBackend,
]


def backend_names() -> list[str]:
    """Names of the registered backends, in the order "auto" tries them (the reference last)."""
    return [b.name for b in _REGISTRY]


def refusals(spec: AttentionSpec, limits: CaptureLimits | None = None) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve ``spec`` (empty: it can)."""
    return {b.name: b.not_supported_reasons(spec, limits) for b in _REGISTRY}


def select_backend(
    spec: AttentionSpec, name: str = "auto", limits: CaptureLimits | None = None
) -> type[AttentionBackend]:
    """The backend class for ``spec`` (and capture ``limits``, if given): the first that fits, or the one named."""
    if name != "auto" and name not in backend_names():
        raise ValueError(f"expected backend to be 'auto' or one of {backend_names()}, got {name!r}")
    candidates = [b for b in _REGISTRY if name in ("auto", b.name)]
    why = {b.name: b.not_supported_reasons(spec, limits) for b in candidates}
    for b in candidates:
        if not why[b.name]:
            return b
    lines = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in why.items())
    what = "no backend fits" if name == "auto" else f"backend {name!r} cannot serve"
    raise ValueError(f"{what} {spec.summary()}:\n{lines}")


def _triton_on_cuda(spec: AttentionSpec) -> bool:
    """Whether this library's Triton kernels can run for ``spec`` (a CUDA device, Triton installed)."""
    return spec.device.type == "cuda" and importlib.util.find_spec("triton") is not None


def select_merge(spec: AttentionSpec) -> MergeFn:
    """The state-merge implementation for ``spec``'s device, chosen once per layer.

    Triton's fused kernel on CUDA when Triton is installed; otherwise the torch
    maths of :func:`twostage_mla.state.merge_states`. Both take
    (o (K, T, H, Dv), lse (K, T, H), *, out_dtype, extra) -> (o, lse).
    """
    if _triton_on_cuda(spec):
        from twostage_mla.kernels.merge import merge_states_triton

        return merge_states_triton
    return merge_states


def select_query_merge(spec: AttentionSpec) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The query pass fused into the final merge, where there is a kernel for it, else None.

    Triton on CUDA in bf16 or fp16: (q (T, H, D), k (T, H_kv, D), v (T, H_kv, Dv), plan,
    ctx_o (K, T, H, Dv), ctx_lse (K, T, H) float32, *, scale, out_dtype, max_q_len) ->
    (o (T, H, Dv) out_dtype, lse (T, H) float32); replaces the backend's query pass and the
    last merge (see :mod:`twostage_mla.kernels.query_merge`).
    """
    # bf16/fp16 only: those ran on GPUs (docs/performance.md); float32 runs only under the interpreter.
    if _triton_on_cuda(spec) and spec.dtype in (torch.bfloat16, torch.float16):
        from twostage_mla.kernels.query_merge import query_merge_triton

        return query_merge_triton
    return None
