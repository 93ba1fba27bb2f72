"""torch's memory-efficient attention (``aten._efficient_attention_forward``): MLA and GQA, no extra package.

The stock GPU path for MLA when FlashInfer is missing: the CUTLASS kernel
vendored from xformers takes any head dim (576/512 included), per-request
lengths through cu_seqlens, and returns lse.

context pass   Non-causal, so the G query heads of one KV head are folded
               into the query rows: q (T, H_kv*G, D) -> (1, T*G, H_kv, D),
               request b owning rows cu_q[b]*G .. cu_q[b+1]*G. For MLA
               (H_kv = 1) that is a free view, and every key is read by one
               block of 32 rows instead of once per head. The kernel has no
               paged entry, so the plan builds a gather index and each layer
               first copies its local context into contiguous K (V is a view
               of K for MLA): about twice the bytes of a paged kernel.
query pass     causal per request (cu_seqlens, custom_mask_type 1 = top-left,
               the same as bottom-right on the square new-token block); K/V
               heads repeated to the query heads (the kernel has no GQA).
Tree masks take the reference dense query pass.

lse comes back (B, H, ceil(max_rows/32)*32) per request row, 0 or garbage
for rows with no keys; the plan precomputes where each token's row is, and
rows with no context are set to (0, -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twostage_mla.backends._paged import empty_context_rows, empty_state, gather_slots, mask_empty_rows, read_slots
from twostage_mla.backends.base import AttentionBackend, AttentionSpec, CaptureLimits, State, gpu_capability
from twostage_mla.plan import StepPlan

_CAUSAL_TOP_LEFT = 1  # sdp::CustomMaskType::CausalFromTopLeft


def _efficient_attention_forward(*args, **kwargs):
    """The kernel, looked up per call (one seam: tests substitute a CPU stand-in)."""
    return torch.ops.aten._efficient_attention_forward(*args, **kwargs)


@dataclass(frozen=True)
class TorchEfficientState:
    """Per-step metadata (StepPlan.backend_state)."""

    slots: torch.Tensor  # (S,) int64 flat cache slot of each local context token
    cu_k: torch.Tensor  # (B+1,) int32 cumulative local context lengths
    max_k: int
    cu_q_folded: torch.Tensor  # (B+1,) int32 query_start_loc * G
    row_req: torch.Tensor  # (T*G,) int64 request of each folded row
    row_off: torch.Tensor  # (T*G,) int64 row index within its request
    empty_rows: torch.Tensor | None  # (T, 1) bool


class TorchEfficientBackend(AttentionBackend):
    """MLA and GQA through torch's memory-efficient kernel; any CUDA GPU torch supports."""

    name = "torch_efficient"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    kv_formats = ("mla", "gqa")

    @classmethod
    def environment_problems(cls, spec: AttentionSpec) -> list[str]:
        out = super().environment_problems(spec)
        if getattr(torch.ops.aten, "_efficient_attention_forward", None) is None:
            out.insert(0, "this torch has no _efficient_attention_forward")
        elif not torch.backends.cuda.mem_efficient_sdp_enabled():
            out.insert(0, "memory-efficient SDPA is disabled (torch.backends.cuda.enable_mem_efficient_sdp)")
        # The kernel has no bf16 variant before sm80: refused here, not at the first layer call.
        have = gpu_capability(spec)
        if spec.dtype == torch.bfloat16 and have and have < (8, 0):
            out.append(f"bf16 needs compute capability >= (8, 0), the GPU has {have}")
        return out

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        # The kernel's fast (aligned) variant wants 16-byte rows; odd dims fall to a slow one.
        if spec.head_dim % 8 or spec.head_dim_v % 8:
            return [f"head dims must be multiples of 8, got {spec.head_dim}/{spec.head_dim_v}"]
        return []

    def __init__(self, spec: AttentionSpec, limits: CaptureLimits | None = None) -> None:
        super().__init__(spec, limits)
        self._g_ctx = spec.num_heads * spec.world_size // spec.num_kv_heads  # query heads per KV head

    def plan(self, plan: StepPlan) -> TorchEfficientState:
        """Gather index, folded row offsets, empty rows (host sync)."""
        slots, cu_k, _ = gather_slots(plan)
        g, dev = self._g_ctx, plan.query_start_loc.device
        # Folded row r = t*G + g of request b sits at row r - cu_q[b]*G of its request's lse.
        rows = torch.arange(plan.num_tokens * g, device=dev)
        row_req = plan.token_request.repeat_interleave(g)
        row_off = rows - plan.query_start_loc.long()[row_req] * g
        return TorchEfficientState(
            slots=slots, cu_k=cu_k, max_k=plan.max_local_context_len,
            cu_q_folded=(plan.query_start_loc * g).to(torch.int32), row_req=row_req, row_off=row_off,
            empty_rows=empty_context_rows(plan),
        )

    def _state(self, plan: StepPlan) -> TorchEfficientState:
        return self._plan_state(plan, TorchEfficientState)

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """q (T, N*H, D) over the local context -> o (T, N*H, Dv) q.dtype, lse (T, N*H) float32.

        Graph-capturable (no host sync; index tensors come from plan).
        """
        st, s = self._state(plan), self.spec
        t, h, dv, hk, g = q.shape[0], q.shape[1], s.head_dim_v, s.num_kv_heads, self._g_ctx
        if t == 0 or st.max_k == 0:
            return empty_state(t, h, dv, q)
        k = read_slots(k_cache, st.slots)  # (S, H_kv, D)
        if s.kv_format == "mla":
            v = k[..., :dv]  # a view: V is the latent part of K
        else:
            v = read_slots(v_cache, st.slots)
        # (T, H_kv*G, D) kv-head-major -> rows (t, g), heads H_kv: free for MLA (H_kv = 1).
        qf = q.reshape(t, hk, g, -1).transpose(1, 2).reshape(1, t * g, hk, q.shape[-1])
        o, lse, *_ = _efficient_attention_forward(
            qf, k[None], v[None], None, st.cu_q_folded, st.cu_k, plan.max_q_len * g, st.max_k, 0.0, 0, True,
            scale=s.scale)
        o = o.reshape(t, g, hk, dv).transpose(1, 2).reshape(t, h, dv)
        lse = lse[st.row_req, :, st.row_off].view(t, g, hk).transpose(1, 2).reshape(t, h)
        return mask_empty_rows(o, lse, st.empty_rows)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal pass over the fresh K/V: q (T, H, D) -> o (T, H, Dv), lse (T, H) float32. Graph-capturable."""
        h = q.shape[1]
        # Query head i reads KV head i // G. The kernel wants as many K/V heads as
        # query heads: repeat them (T*H rows of fresh K/V, a few MB at most).
        kx = k.repeat_interleave(h // k.shape[1], dim=1)
        vx = v.repeat_interleave(h // v.shape[1], dim=1)
        qsl = plan.query_start_loc
        o, lse, *_ = _efficient_attention_forward(
            q[None], kx[None], vx[None], None, qsl, qsl, plan.max_q_len, plan.max_q_len, 0.0, _CAUSAL_TOP_LEFT, True,
            scale=self.spec.scale)
        return o[0], lse[plan.token_request, :, plan.token_offset]
