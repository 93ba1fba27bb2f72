"""Reference backend: plain torch, float32 maths, any device.

Requests are grouped by the length of what they read (a power of two per
group), each group padded to its longest and run as one dense masked
softmax: a batch of decodes costs a few batched ops, and a long chunk or a
long context among short ones pads only its own group (at most 2x per
length). Slow but simple and exact: the CPU default, and the fallback for
masks that a fast kernel cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from twostage_mla.backends._dense import Group, attend_group, group_state, query_group, real_rows, token_group
from twostage_mla.backends._paged import read_slots
from twostage_mla.backends.base import AttentionBackend, State
from twostage_mla.plan import StepPlan


@dataclass(frozen=True)
class ReferenceState:
    """Groups built once in plan() (host reads), so the layer call needs no sync."""

    context: list[Group]  # requests with local context, grouped by (context, q_len) length
    query: list[Group]  # requests with tokens, grouped by q_len


def _groups(plan: StepPlan, by_context: bool) -> list[Group]:
    q_lens, ctx = plan.q_lens.tolist(), plan.local_context_lens.tolist()
    keys: dict[tuple[int, int], list[int]] = {}
    for b, (n, c) in enumerate(zip(q_lens, ctx)):
        if n and (c or not by_context):
            keys.setdefault((n.bit_length(), c.bit_length() if by_context else 0), []).append(b)
    dev, ps, out = plan.query_start_loc.device, plan.page_size, []
    for reqs in keys.values():
        r = torch.tensor(reqs, dtype=torch.int64, device=dev)
        g = token_group(plan, r, max(q_lens[b] for b in reqs))
        if by_context:
            i = torch.arange(max(ctx[b] for b in reqs), device=dev)
            key_ok = i[None] < plan.local_context_lens.long()[r, None]
            slots = torch.where(key_ok, plan.block_table.long()[r[:, None], i[None] // ps] * ps + i[None] % ps, 0)
            g = replace(g, slots=slots, key_ok=key_ok)
        out.append(g)
    return out


class ReferenceBackend(AttentionBackend):
    name = "reference"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # no float64: its maths is float32 (not float64-exact)
    kv_formats = ("mla", "gqa")

    def plan(self, plan: StepPlan) -> ReferenceState:
        """Group the step's requests (host sync)."""
        return ReferenceState(_groups(plan, True), _groups(plan, False))

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        out = group_state(plan, q, v_cache.shape[-1])
        for g in self._plan_state(plan, ReferenceState).context:
            mask = g.key_ok[:, None, :].expand(-1, g.tokens.shape[1], -1)
            kg, vg = read_slots(k_cache, g.slots), read_slots(v_cache, g.slots)
            attend_group(q, kg, vg, mask, g, self.spec.scale, out)
        return real_rows(out)

    def query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal per request, or plan.query_mask (a tree); shapes as in the base class."""
        out = group_state(plan, q, v.shape[-1])
        for g in self._plan_state(plan, ReferenceState).query:
            query_group(q, k, v, plan, g, self.spec.scale, out)
        return real_rows(out)
