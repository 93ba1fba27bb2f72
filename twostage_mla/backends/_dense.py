"""Dense masked attention in float32: the reference backend's maths, and every backend's tree query pass.

``dense_query`` pads each request's queries to (B, max_q_len) and attends with
an explicit mask (no host sync: a graph may capture it); slow but simple and exact. A module of its own because both
reference.py and the backends' base (the tree-mask fallback of
``AttentionBackend.query``) use it.
"""

from __future__ import annotations

import torch
from einops import rearrange

from twostage_mla.plan import StepPlan


def pad(x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """(T, ...) -> (B, max_q_len, ...), zeros where a request has fewer tokens."""
    out = x.new_zeros((plan.batch_size, plan.max_q_len, *x.shape[1:]))
    out[plan.token_request, plan.token_offset] = x
    return out


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


def dense_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query pass, dense: causal per request, or plan.query_mask (a tree).

    q: (T, H, D); k: (T, H_kv, D); v: (T, H_kv, Dv).
    returns o (T, H, Dv) q.dtype, lse (T, H) float32.
    """
    mask = plan.query_mask
    if mask is None:
        j = torch.arange(plan.max_q_len, device=q.device)
        mask = (j[None, :] <= j[:, None]).expand(plan.batch_size, -1, -1)
    else:  # a mask may be wider than the step (a fixed buffer's): its top-left corner
        mask = mask[: plan.batch_size, : plan.max_q_len, : plan.max_q_len]
    o, lse = dense_attention(pad(q, plan), pad(k, plan), pad(v, plan), mask, scale)
    return o[plan.token_request, plan.token_offset].to(q.dtype), lse[plan.token_request, plan.token_offset]
