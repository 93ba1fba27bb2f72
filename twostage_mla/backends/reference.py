"""Reference backend: plain torch, float32 maths, any device.

Both passes pad each request's queries to (B, max_q_len) and run a dense
masked softmax; the context pass first gathers each request's local keys from
its pages. Slow but simple and exact: the CPU default, and the fallback for
masks that a fast kernel cannot express.
"""

from __future__ import annotations

import torch

from twostage_mla.backends._dense import dense_attention, dense_query, pad
from twostage_mla.backends._paged import read_slots
from twostage_mla.backends.base import AttentionBackend, State
from twostage_mla.plan import StepPlan


class ReferenceBackend(AttentionBackend):
    name = "reference"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # no float64: its maths is float32 (not float64-exact)
    kv_formats = ("mla", "gqa")

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        ps, n = plan.page_size, plan.max_local_context_len
        idx = torch.arange(n, device=q.device)
        visible = idx[None, :] < plan.local_context_lens[:, None].long()  # (B, n)
        pages = plan.block_table.long()[:, idx // ps]  # (B, n)
        # Table entries past a request's length may hold anything: read slot 0 there.
        slots = torch.where(visible, pages * ps + idx % ps, 0)
        # Zero what is not visible: slot 0 of an engine's cache may hold NaN, and 0 * NaN = NaN.
        hide = ~visible[:, :, None, None]
        k = read_slots(k_cache, slots).masked_fill(hide, 0)  # (B, n, H_kv, D)
        v = read_slots(v_cache, slots).masked_fill(hide, 0)
        mask = visible[:, None, :].expand(-1, plan.max_q_len, -1)
        o, lse = dense_attention(pad(q, plan), k, v, mask, self.spec.scale)
        return o[plan.token_request, plan.token_offset].to(q.dtype), lse[plan.token_request, plan.token_offset]

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        return dense_query(q, k, v, plan, self.spec.scale)
