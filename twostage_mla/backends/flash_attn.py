"""flash-attn adapters (extra ``flash-attn``): FA3 (``flash_attn_interface``) and FA2 (``flash_attn``).

NEVER RUN: neither package has a wheel for the GPU machine this project is
tested on (H200, torch 2.11 + CUDA 13), and neither builds there in a call's
time. These adapters were written from the packages' documented Python API
(``hopper/flash_attn_interface.py``, ``flash_attn/flash_attn_interface.py``);
tests/test_backends_emulated.py runs them on the CPU against stand-ins that
implement that documented contract (shapes, lse layout), and
tests/test_backends_gpu.py runs them wherever the package is installed. Both
refuse cleanly (environment_problems) when the package is missing.

FA3, ``flash_attn3`` (Hopper):
  MLA context  flash_attn_with_kvcache(q=q_pe, k_cache=kpe, v_cache=ckv,
               qv=q_nope, page_table, cache_seqlens, cu_seqlens_q): the
               "qv" form FA3 has for absorbed MLA (rope 64, latent 512).
  MLA query    flash_attn_varlen_func(q_pe, k_pe, ckv, qv=q_nope, causal).
  GQA          with_kvcache (paged, any page size) / varlen_func causal.
FA2, ``flash_attn2`` (sm80+), GQA only:
  context      flash_attn_varlen_func(..., block_table): FA2's paged KV needs
               pages of a multiple of 256 tokens (smaller pages: torch_flash).
  query        flash_attn_varlen_func(..., causal=True).
lse: varlen lse is (H, T) (older FA2 releases: (B, H, max_q), also read);
rows with no context get FA2's +inf: set to the empty state (0, -inf).
Tree masks take the reference dense query pass.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from twostage_mla.backends._paged import empty_context_rows, empty_state, key_indptr, lse_heads_major, mask_empty_rows
from twostage_mla.backends.base import AttentionBackend, AttentionSpec, CaptureLimits, State, gpu_capability
from twostage_mla.plan import StepPlan


@dataclass(frozen=True)
class FlashAttnState:
    """Per-step metadata (StepPlan.backend_state)."""

    key_indptr: torch.Tensor  # (B+1,) int32 cumulative local context lengths
    max_k: int
    empty_rows: torch.Tensor | None  # (T, 1) bool


def fa2_head_dims(spec: AttentionSpec) -> list[str]:
    """Why FA2's kernel (flash-attn's, or torch's vendored copy) cannot take spec's head dims; [] if it can."""
    if spec.head_dim != spec.head_dim_v or spec.head_dim % 8:
        return [f"FA2 needs head_dim == head_dim_v, a multiple of 8, got {spec.head_dim}/{spec.head_dim_v}"]
    return []


def _lse_tokens(lse: torch.Tensor, plan: StepPlan, h: int) -> torch.Tensor:
    """Kernel lse, (H, T) or the older padded (B, H, max_q), as (T, H) float32."""
    if lse.dim() == 2:
        return lse_heads_major(lse, plan.num_tokens, h)
    return lse[plan.token_request, :, plan.token_offset].float()


def _first_two(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from a call that returns (out, lse, ...) — the extras vary between releases."""
    return res[0], res[1]


class _FlashAttnBase(AttentionBackend):
    module: str = ""
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self, spec: AttentionSpec, limits: CaptureLimits | None = None) -> None:
        super().__init__(spec, limits)
        self._fa: Any = None

    def _lib(self) -> Any:
        if self._fa is None:
            self._fa = importlib.import_module(self.module)  # lazy: optional package
        return self._fa

    def plan(self, plan: StepPlan) -> FlashAttnState:
        """Key offsets and empty rows (host sync)."""
        self._lib()  # import now, not inside a graph capture
        return FlashAttnState(key_indptr(plan), plan.max_local_context_len, empty_context_rows(plan))

    def _state(self, plan: StepPlan) -> FlashAttnState:
        return self._plan_state(plan, FlashAttnState)


class FlashAttn3Backend(_FlashAttnBase):
    """FA3 (Hopper): MLA through ``qv`` (rope 64 + latent 512), GQA with head dim <= 256."""

    name = "flash_attn3"
    module = "flash_attn_interface"
    packages = ("flash_attn_interface",)
    kv_formats = ("mla", "gqa")
    min_compute_capability = (9, 0)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        if spec.kv_format == "mla" and (spec.head_dim - spec.head_dim_v, spec.head_dim_v) != (64, 512):
            return [f"FA3's MLA form (qv) is for rope 64 + latent 512, got {spec.head_dim - spec.head_dim_v} + "
                    f"{spec.head_dim_v}"]
        d, dv = spec.head_dim, spec.head_dim_v
        if spec.kv_format == "gqa" and (d > 256 or dv > 256 or d % 8):
            return [f"FA3 GQA needs head dims <= 256, multiples of 8, got {d}/{dv}"]
        # FA3's mha_fwd (hopper/flash_api.cpp) takes a V head dim other than K's only in these ranges.
        if spec.kv_format == "gqa" and d != dv and not ((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512)):
            return [f"FA3 takes K and V head dims that differ only as (128, 192] / (96, 128] or <= 64 / <= 512, "
                    f"got {d}/{dv}"]  # fmt: skip
        return []

    @classmethod
    def environment_problems(cls, spec: AttentionSpec) -> list[str]:
        out = super().environment_problems(spec)
        # A V head dim other than K's (MLA's qv form included) is Hopper only in FA3 ("Only Hopper
        # supports different V headdim").
        differs = spec.kv_format == "mla" or spec.head_dim != spec.head_dim_v
        have = gpu_capability(spec)
        if differs and have and have[0] != 9:
            out.append(f"FA3 runs a V head dim other than K's on Hopper (sm90) only, the GPU has {have}")
        return out

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """q (T, N*H, D) over the paged shard -> o (T, N*H, Dv), lse (T, N*H) float32. Graph-capturable."""
        st, s = self._state(plan), self.spec
        t, h, dv = q.shape[0], q.shape[1], s.head_dim_v
        if t == 0 or st.max_k == 0:
            return empty_state(t, h, dv, q)
        fa = self._lib()
        common = dict(cache_seqlens=plan.local_context_lens, page_table=plan.block_table,
                      cu_seqlens_q=plan.query_start_loc, max_seqlen_q=plan.max_q_len,
                      softmax_scale=s.scale, causal=False, return_softmax_lse=True)
        if s.kv_format == "mla":
            o, lse = _first_two(fa.flash_attn_with_kvcache(
                q[..., dv:], k_cache[..., dv:], k_cache[..., :dv], qv=q[..., :dv], **common))
        else:
            o, lse = _first_two(fa.flash_attn_with_kvcache(q, k_cache, v_cache, **common))
        return mask_empty_rows(o, _lse_tokens(lse, plan, h), st.empty_rows)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal varlen pass: q (T, H, D) -> o (T, H, Dv), lse (T, H) float32. Graph-capturable."""
        s = self.spec
        h, dv = q.shape[1], s.head_dim_v
        fa, qsl, mq = self._lib(), plan.query_start_loc, plan.max_q_len
        if s.kv_format == "mla":
            res = fa.flash_attn_varlen_func(q[..., dv:], k[..., dv:], k[..., :dv], qsl, qsl, mq, mq,
                                            softmax_scale=s.scale, causal=True, qv=q[..., :dv],
                                            return_attn_probs=True)
        else:
            res = fa.flash_attn_varlen_func(q, k, v, qsl, qsl, mq, mq, softmax_scale=s.scale, causal=True,
                                            return_attn_probs=True)
        o, lse = _first_two(res)
        return o, _lse_tokens(lse, plan, h)


class FlashAttn2Backend(_FlashAttnBase):
    """FA2: GQA with head dim <= 256 and pages of a multiple of 256 tokens."""

    name = "flash_attn2"
    module = "flash_attn"
    packages = ("flash_attn",)
    min_version = ("flash-attn", "2.6")  # the extra's floor; never run here (no wheel)
    kv_formats = ("gqa",)
    max_head_dim = 256
    page_size_multiple = 256  # FA2's paged KV rule
    min_compute_capability = (8, 0)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        return fa2_head_dims(spec)

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """q (T, N*H, D) over the paged shard -> o (T, N*H, D), lse (T, N*H) float32. Graph-capturable."""
        st = self._state(plan)
        t, h = q.shape[0], q.shape[1]
        if t == 0 or st.max_k == 0:
            return empty_state(t, h, self.spec.head_dim_v, q)
        o, lse = _first_two(self._lib().flash_attn_varlen_func(
            q, k_cache, v_cache, plan.query_start_loc, st.key_indptr, plan.max_q_len, st.max_k,
            softmax_scale=self.spec.scale, causal=False, return_attn_probs=True, block_table=plan.block_table))
        return mask_empty_rows(o, _lse_tokens(lse, plan, h), st.empty_rows)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal varlen pass: q (T, H, D) -> o (T, H, D), lse (T, H) float32. Graph-capturable."""
        h = q.shape[1]
        qsl, mq = plan.query_start_loc, plan.max_q_len
        o, lse = _first_two(self._lib().flash_attn_varlen_func(
            q, k, v, qsl, qsl, mq, mq, softmax_scale=self.spec.scale, causal=True, return_attn_probs=True))
        return o, _lse_tokens(lse, plan, h)
