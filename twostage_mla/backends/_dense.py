"""Dense masked attention in float32: the reference backend's maths, and every backend's tree query pass.

Queries are padded per request to (B, max_q_len) and attend with an explicit
mask; slow but simple and exact. A module of its own because both
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, *, per_key: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in float32, grouped-query aware.

    q: (B, Sq, H, D); k: (B, Sk, H_kv, D); v: (B, Sk, H_kv, Dv); H % H_kv == 0,
    query head h reads kv head h // (H // H_kv).
    mask: (B, Sq, Sk) bool, True = visible.
    per_key: sum the values one key at a time, each only where it is visible. A masked key has
        weight 0, but 0 * NaN = NaN: with per_key=False the caller must zero the keys no query
        sees, which works only where every query of a request sees the same keys (the context
        pass). The query pass's keys are few, so the loop is short.
    returns o (B, Sq, H, Dv) float32, lse (B, Sq, H) float32; (0, -inf) where
    a row sees nothing.
    """
    hk = k.shape[2]
    qg = rearrange(q.float(), "b s (k g) d -> b k g s d", k=hk)
    s = torch.einsum("bkgsd,btkd->bkgst", qg, k.float()) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    if per_key:
        o = qg.new_zeros((*p.shape[:-1], v.shape[-1]))
        for t in range(v.shape[1]):
            term = p[..., t, None] * v[:, t, :, None, None, :].float()  # (B, H_kv, G, Sq, Dv)
            o += torch.where(mask[:, None, None, :, t, None], term, 0.0)
    else:
        o = torch.einsum("bkgst,btkd->bkgsd", p, v.float())
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
    o, lse = dense_attention(pad(q, plan), pad(k, plan), pad(v, plan), mask, scale, per_key=True)
    return o[plan.token_request, plan.token_offset].to(q.dtype), lse[plan.token_request, plan.token_offset]
