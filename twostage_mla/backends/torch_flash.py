"""torch's vendored FlashAttention-2 (``torch.ops.aten._flash_attention_forward``): GQA in every CUDA torch.

context pass   varlen, non-causal. Where this torch's op takes a
               ``block_table`` and the page size is a multiple of 256 (FA2's
               paged-KV rule) it reads the pages in place; otherwise the plan
               builds a gather index and each layer first copies its local
               context into contiguous K/V (about twice the bytes of a
               paged kernel: a fallback, not the fast path).
query pass     varlen, causal (square per request, so top-left = bottom-right).
Tree masks take the reference dense query pass.

lse comes back (H, T) and +inf for rows with no keys: transposed and, for
rows with no context, set to the empty state (0, -inf).
Head dim at most 256 and equal for K and V, so MLA (576/512) is not served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twostage_mla.backends._paged import (
    empty_context_rows,
    empty_state,
    gather_slots,
    key_indptr,
    lse_heads_major,
    mask_empty_rows,
    read_slots,
)
from twostage_mla.backends.base import AttentionBackend, AttentionSpec, CaptureLimits, State
from twostage_mla.backends.flash_attn import fa2_head_dims
from twostage_mla.plan import StepPlan


def _op_takes(arg: str) -> bool:
    """Whether this torch's _flash_attention_forward has keyword ``arg`` (block_table came later)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and any(a.name == arg for a in op.default._schema.arguments)


def _flash_attention_forward(*args, **kwargs):
    """The kernel, looked up per call (one seam: tests substitute a CPU stand-in)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


@dataclass(frozen=True)
class TorchFlashState:
    """Per-step metadata (StepPlan.backend_state)."""

    paged: bool  # read pages in place (block_table) rather than gather
    slots: torch.Tensor | None  # (S,) int64 gather index, when not paged
    key_indptr: torch.Tensor  # (B+1,) int32 cumulative local context lengths
    max_k: int  # longest local context
    empty_rows: torch.Tensor | None  # (T, 1) bool


class TorchFlashBackend(AttentionBackend):
    """GQA through torch's FA2: fp16/bf16, sm80+, head dim <= 256 (K and V equal)."""

    name = "torch_flash"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    kv_formats = ("gqa",)
    max_head_dim = 256
    min_compute_capability = (8, 0)

    @classmethod
    def environment_problems(cls, spec: AttentionSpec) -> list[str]:
        out = super().environment_problems(spec)
        op = getattr(torch.ops.aten, "_flash_attention_forward", None)
        if op is None or not torch.backends.cuda.is_flash_attention_available():
            out.insert(0, "this torch was built without flash attention")
        return out

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        return fa2_head_dims(spec)

    def __init__(self, spec: AttentionSpec, limits: CaptureLimits | None = None) -> None:
        super().__init__(spec, limits)
        self._paged_ok = _op_takes("block_table") and spec.page_size % 256 == 0

    def plan(self, plan: StepPlan) -> TorchFlashState:
        """Gather index (if needed), key offsets, empty rows (host sync)."""
        slots = None if self._paged_ok else gather_slots(plan)[0]
        return TorchFlashState(
            self._paged_ok, slots, key_indptr(plan), plan.max_local_context_len, empty_context_rows(plan)
        )

    def _state(self, plan: StepPlan) -> TorchFlashState:
        return self._plan_state(plan, TorchFlashState)

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """q (T, N*H, D) over the local context -> o (T, N*H, D) q.dtype, lse (T, N*H) float32.

        Graph-capturable (no host sync; the gather index was built in plan).
        """
        st = self._state(plan)
        t, h = q.shape[0], q.shape[1]
        if t == 0 or st.max_k == 0:
            return empty_state(t, h, self.spec.head_dim_v, q)
        common = dict(scale=self.spec.scale)
        if st.paged:
            o, lse, *_ = _flash_attention_forward(
                q, k_cache, v_cache, plan.query_start_loc, st.key_indptr, plan.max_q_len, st.max_k, 0.0, False,
                False, seqused_k=plan.local_context_lens, block_table=plan.block_table, **common)
        else:
            k = read_slots(k_cache, st.slots)  # (S, H_kv, D)
            v = read_slots(v_cache, st.slots)
            o, lse, *_ = _flash_attention_forward(
                q, k, v, plan.query_start_loc, st.key_indptr, plan.max_q_len, st.max_k, 0.0, False, False, **common)
        return mask_empty_rows(o, lse_heads_major(lse, t, h), st.empty_rows)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal varlen pass: q (T, H, D) -> o (T, H, D), lse (T, H) float32. Graph-capturable."""
        t, h = q.shape[0], q.shape[1]
        qsl = plan.query_start_loc
        o, lse, *_ = _flash_attention_forward(
            q, k, v, qsl, qsl, plan.max_q_len, plan.max_q_len, 0.0, True, False, scale=self.spec.scale)
        return o, lse_heads_major(lse, t, h)
