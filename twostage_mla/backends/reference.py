"""Reference backend: plain torch, float32 maths, any device.

Requests are grouped by the length of what they read (a power of two per
group), each group padded to its longest and run as one dense masked
softmax: a batch of decodes costs a few batched ops, and a long chunk or a
long context among short ones pads only its own group (at most 2x per
length). Slow but simple and exact: the CPU default, and the fallback for
masks that a fast kernel cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twostage_mla.backends._dense import dense_attention
from twostage_mla.backends._paged import read_slots
from twostage_mla.backends.base import AttentionBackend, State
from twostage_mla.plan import StepPlan


@dataclass(frozen=True)
class _Group:
    """Requests padded together: their queries, and (context pass) their cache slots."""

    requests: torch.Tensor  # (G,) int64
    tokens: torch.Tensor  # (G, Sq) int64: request's j-th token in q (0 past its end)
    token_ok: torch.Tensor  # (G, Sq) bool
    slots: torch.Tensor | None = None  # (G, Sk) int64 flat cache slots (0 past its local context)
    key_ok: torch.Tensor | None = None  # (G, Sk) bool


@dataclass(frozen=True)
class ReferenceState:
    """Groups built once in plan() (host reads), so the layer call needs no sync."""

    context: list[_Group]  # requests with local context, grouped by (context, q_len) length
    query: list[_Group]  # requests with tokens, grouped by q_len


def _groups(plan: StepPlan, by_context: bool) -> list[_Group]:
    q_lens, ctx = plan.q_lens.tolist(), plan.local_context_lens.tolist()
    keys: dict[tuple[int, int], list[int]] = {}
    for b, (n, c) in enumerate(zip(q_lens, ctx)):
        if n and (c or not by_context):
            keys.setdefault((n.bit_length(), c.bit_length() if by_context else 0), []).append(b)
    dev, ps, out = plan.query_start_loc.device, plan.page_size, []
    for reqs in keys.values():
        r = torch.tensor(reqs, dtype=torch.int64, device=dev)
        j = torch.arange(max(q_lens[b] for b in reqs), device=dev)
        token_ok = j[None] < plan.q_lens.long()[r, None]
        tokens = torch.where(token_ok, plan.query_start_loc.long()[r, None] + j[None], 0)
        if not by_context:
            out.append(_Group(r, tokens, token_ok))
            continue
        i = torch.arange(max(ctx[b] for b in reqs), device=dev)
        key_ok = i[None] < plan.local_context_lens.long()[r, None]
        slots = torch.where(key_ok, plan.block_table.long()[r[:, None], i[None] // ps] * ps + i[None] % ps, 0)
        out.append(_Group(r, tokens, token_ok, slots, key_ok))
    return out


def _empty(q: torch.Tensor, dv: int) -> State:
    o = q.new_zeros((q.shape[0], q.shape[1], dv))
    return o, torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)


class ReferenceBackend(AttentionBackend):
    name = "reference"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # no float64: its maths is float32 (not float64-exact)
    kv_formats = ("mla", "gqa")

    def plan(self, plan: StepPlan) -> ReferenceState:
        """Group the step's requests (host sync)."""
        return ReferenceState(_groups(plan, True), _groups(plan, False))

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        o, lse = _empty(q, v_cache.shape[-1])
        for g in self._plan_state(plan, ReferenceState).context:
            kg, vg = read_slots(k_cache, g.slots), read_slots(v_cache, g.slots)
            mask = g.key_ok[:, None, :].expand(-1, g.tokens.shape[1], -1)
            og, lg = dense_attention(q[g.tokens], kg, vg, mask, self.spec.scale)
            at = g.tokens[g.token_ok]
            o[at], lse[at] = og[g.token_ok].to(o.dtype), lg[g.token_ok]
        return o, lse

    def query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal per request, or plan.query_mask (a tree); shapes as in the base class."""
        o, lse = _empty(q, v.shape[-1])
        for g in self._plan_state(plan, ReferenceState).query:
            n = g.tokens.shape[1]
            if plan.query_mask is None:
                sees = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]
            else:  # a mask may be wider than the step (a fixed buffer's): each request's top-left corner
                sees = plan.query_mask[g.requests, :n, :n]
            mask = sees & g.token_ok[:, None, :]
            og, lg = dense_attention(q[g.tokens], k[g.tokens], v[g.tokens], mask, self.spec.scale)
            at = g.tokens[g.token_ok]
            o[at], lse[at] = og[g.token_ok].to(o.dtype), lg[g.token_ok]
        return o, lse
