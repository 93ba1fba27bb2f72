"""Dense masked attention in float32: the reference backend's maths, and every backend's tree query pass.

Requests are attended in groups, each padded to its longest request, with an
explicit mask; slow but simple and exact. The reference backend groups them
by length at plan time; ``dense_query`` (every backend's tree-mask fallback)
puts all in one group. No host sync once the groups are built, so a graph may
capture a layer call: padded tokens are written to a spare row T of the
output (``group_state``) rather than picked out with a boolean mask (a
``nonzero``, a sync). A module of its own because both reference.py and the
backends' base use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from twostage_mla.backends._paged import empty_state
from twostage_mla.plan import StepPlan

State = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Group:
    """Requests attended together, padded to the longest of them."""

    requests: torch.Tensor  # (G,) int64
    tokens: torch.Tensor  # (G, Sq) int64: request's j-th token in q (0 past its end)
    token_ok: torch.Tensor  # (G, Sq) bool
    dest: torch.Tensor  # (G, Sq) int64: the output row of each, T (the spare row) past its end
    slots: torch.Tensor | None = None  # (G, Sk) int64 flat cache slots (0 past its local context): context pass
    key_ok: torch.Tensor | None = None  # (G, Sk) bool


def token_group(plan: StepPlan, requests: torch.Tensor, width: int) -> Group:
    """The group of ``requests`` (G,) int64, their tokens padded to ``width`` (no host sync)."""
    j = torch.arange(width, device=requests.device)
    token_ok = j[None] < plan.q_lens.long()[requests, None]
    tokens = torch.where(token_ok, plan.query_start_loc.long()[requests, None] + j[None], 0)
    return Group(requests, tokens, token_ok, torch.where(token_ok, tokens, plan.num_tokens))


def group_state(plan: StepPlan, q: torch.Tensor, dv: int) -> State:
    """The empty state of q's T = plan.num_tokens tokens with a spare row T, where groups write
    their padding (Group.dest): pass it to :func:`attend_group` / :func:`query_group`, then keep
    :func:`real_rows`. q: (T, H, D); o: (T+1, H, dv) q.dtype, lse (T+1, H) float32."""
    if q.shape[0] != plan.num_tokens:  # the spare row is plan.num_tokens: another T would write over a real row
        raise ValueError(f"expected q with T = plan.num_tokens = {plan.num_tokens} rows, got {tuple(q.shape)}")
    return empty_state(plan.num_tokens + 1, q.shape[1], dv, q)


def real_rows(out: State) -> State:
    """A :func:`group_state` without its spare row: o (T, H, Dv), lse (T, H)."""
    return out[0][:-1], out[1][:-1]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in float32, grouped-query aware.

    q: (B, Sq, H, D); k: (B, Sk, H_kv, D); v: (B, Sk, H_kv, Dv); H % H_kv == 0,
    query head h reads kv head h // (H // H_kv).
    mask: (B, Sq, Sk) bool, True = visible; None: every key visible.
    returns o (B, Sq, H, Dv) float32, lse (B, Sq, H) float32; (0, -inf) where
    a row sees nothing. A value that is not finite reaches (as NaN) only the
    rows that see its key.
    """
    hk = k.shape[2]
    qg = rearrange(q.float(), "b s (k g) d -> b k g s d", k=hk)
    s = torch.einsum("bkgsd,btkd->bkgst", qg, k.float()) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    # A key a row does not see has weight 0, but 0 x NaN = NaN: sum the finite values, then
    # mark NaN where a row sees a value that is not finite (as a stock kernel spreads it).
    v = v.float()
    bad = ~torch.isfinite(v)
    o = torch.einsum("bkgst,btkd->bkgsd", p, v.masked_fill(bad, 0.0))
    seen = torch.ones_like(s[:, 0, 0]) if mask is None else mask.float()  # (B, Sq, Sk)
    hits = torch.einsum("bst,btkd->bksd", seen, bad.float())
    o = o.masked_fill(hits[:, :, None] > 0, float("nan"))
    return rearrange(o, "b k g s d -> b s (k g) d"), rearrange(lse, "b k g s -> b s (k g)")


def attend_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, g: Group, scale: float, out: State
) -> None:
    """The group's queries (from q (T, H, D)) over k (G, Sk, H_kv, D), v (G, Sk, H_kv, Dv) under
    mask (G, Sq, Sk); their rows written into out = (o (T+1, H, Dv), lse (T+1, H) float32) from
    :func:`group_state` (row T takes the padding)."""
    og, lg = dense_attention(q[g.tokens], k, v, mask, scale)
    out[0][g.dest], out[1][g.dest] = og.to(out[0].dtype), lg


def query_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, g: Group, scale: float,
                out: State) -> None:  # fmt: skip
    """The query pass of the group's requests, causal or plan.query_mask (a tree), into out."""
    n = g.tokens.shape[1]
    if plan.query_mask is None:
        sees = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]
    else:  # a mask may be wider than the step (a fixed buffer's): each request's top-left corner
        sees = plan.query_mask[g.requests, :n, :n]
    attend_group(q, k[g.tokens], v[g.tokens], sees & g.token_ok[:, None, :], g, scale, out)


def dense_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, scale: float) -> State:
    """The query pass, dense: causal per request, or plan.query_mask (a tree).

    q: (T, H, D); k: (T, H_kv, D); v: (T, H_kv, Dv).
    returns o (T, H, Dv) q.dtype, lse (T, H) float32. Every request in one
    group, padded to max_q_len: no host sync.
    """
    out = group_state(plan, q, v.shape[-1])
    every = torch.arange(plan.batch_size, device=q.device)
    query_group(q, k, v, plan, token_group(plan, every, plan.max_q_len), scale, out)
    return real_rows(out)
