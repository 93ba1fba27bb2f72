"""Reference backend: plain torch, float32 maths, any device.

One request at a time: its queries attend its own keys with a dense softmax
(every key visible in the context pass; causal, or the tree mask, in the
query pass), so time and memory follow each request's own lengths, not the
batch's longest. Slow but simple and exact: the CPU default, and the
fallback for masks that a fast kernel cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twostage_mla.backends._dense import dense_attention
from twostage_mla.backends._paged import gather_slots, read_slots
from twostage_mla.backends.base import AttentionBackend, State
from twostage_mla.plan import StepPlan


@dataclass(frozen=True)
class ReferenceState:
    """Host offsets of each request, read once in plan() (the layer call then needs no sync)."""

    queries: list[tuple[int, int]]  # request b's tokens: q[start:end]
    keys: list[tuple[int, int]]  # its local context: slots[start:end]
    slots: torch.Tensor  # (S,) int64 flat cache slots of every local context, requests concatenated


def _spans(indptr: torch.Tensor) -> list[tuple[int, int]]:
    at = indptr.tolist()
    return list(zip(at[:-1], at[1:]))


def _empty(q: torch.Tensor, dv: int) -> State:
    o = q.new_zeros((q.shape[0], q.shape[1], dv))
    return o, torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # no float64: its maths is float32 (not float64-exact)
    kv_formats = ("mla", "gqa")

    def plan(self, plan: StepPlan) -> ReferenceState:
        """Each request's token and key offsets (host sync)."""
        slots, key_indptr, _ = gather_slots(plan)
        return ReferenceState(_spans(plan.query_start_loc), _spans(key_indptr), slots)

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        st = self._plan_state(plan, ReferenceState)
        o, lse = _empty(q, v_cache.shape[-1])
        for (q0, q1), (k0, k1) in zip(st.queries, st.keys):
            if q1 > q0 and k1 > k0:
                slots = st.slots[k0:k1]
                kb, vb = read_slots(k_cache, slots)[None], read_slots(v_cache, slots)[None]
                ob, lb = dense_attention(q[None, q0:q1], kb, vb, None, self.spec.scale)
                o[q0:q1], lse[q0:q1] = ob[0].to(o.dtype), lb[0]
        return o, lse

    def query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal per request, or plan.query_mask (a tree); shapes as in the base class."""
        st = self._plan_state(plan, ReferenceState)
        o, lse = _empty(q, v.shape[-1])
        causal = torch.ones(plan.max_q_len, plan.max_q_len, dtype=torch.bool, device=q.device).tril()
        for b, (q0, q1) in enumerate(st.queries):
            n = q1 - q0
            if n:
                mask = causal[:n, :n] if plan.query_mask is None else plan.query_mask[b, :n, :n]
                ob, lb = dense_attention(q[None, q0:q1], k[None, q0:q1], v[None, q0:q1], mask[None], self.spec.scale)
                o[q0:q1], lse[q0:q1] = ob[0].to(o.dtype), lb[0]
        return o, lse
