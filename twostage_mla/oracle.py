"""Float64 dense oracle: attention with the true causal mask over unsharded KV.

Use it to check an integration: shard the same K/V, run the layer on every
rank, and compare each rank's output with the oracle of that rank's q heads
(GQA groups heads within what it is given: see ``oracle_attention``).
"""

from __future__ import annotations

import torch
from einops import rearrange

from twostage_mla.layer import _check_scale
from twostage_mla.layout import _int_tensor
from twostage_mla.plan import _step_lengths, _tree_mask


def oracle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    parents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of every query over its request's whole, unsharded KV.

    q: (T, H, D) any float dtype (computed in float64); the Q_b queries of request b are its last Q_b positions
        C_b .. seq_lens[b]-1. Head h reads K/V head h // (H / H_kv): for GQA
        pass one rank's heads (a layer's heads read its H_kv heads in groups
        of its own H / H_kv); for MLA (H_kv = 1) any heads.
    k: (S, H_kv, D), v: (S, H_kv, Dv), any float dtype: every request's positions 0 .. seq_lens[b]-1,
        requests concatenated (S = seq_lens.sum()); for MLA pass
        v = k[..., :kv_lora_rank] with H_kv = 1.
    query_start_loc: (B+1,) int; seq_lens: (B,) int.
    scale: a finite float > 0, as in :class:`AttentionConfig`.
    parents: optional (T,) int tree parents as in :func:`plan_step`; query j
        then sees the context and its ancestors-or-self among the new tokens.
    returns o (T, H, Dv) float64, lse (T, H) float64 (natural log).
    Raises ValueError naming the argument where these shapes or lengths disagree.

    >>> q, kv = torch.randn(3, 4, 8), torch.randn(10, 1, 8)
    >>> o, lse = oracle_attention(q, kv, kv[..., :6], torch.tensor([0, 3]), torch.tensor([10]), 0.3)
    >>> o.shape, lse.shape
    (torch.Size([3, 4, 6]), torch.Size([3, 4]))
    """
    qsl, sl, _ = _step_lengths(_int_tensor("query_start_loc", query_start_loc, 1), _int_tensor("seq_lens", seq_lens, 1))
    scale = _check_scale(scale)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point() or x.device.type == "meta":
            got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"expected {name}: a 3-D floating-point tensor with values, got {got}")
    h, hk = q.shape[1], k.shape[1]
    if q.shape[0] != qsl[-1] or q.shape[2] != k.shape[2] or hk < 1 or h % hk:
        raise ValueError(
            f"expected q: (T = query_start_loc[-1] = {qsl[-1]}, H a multiple of H_kv = {hk}, D = {k.shape[2]}), "
            f"got {tuple(q.shape)}"
        )
    if k.shape[0] != sum(sl) or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expected k: (S = seq_lens.sum() = {sum(sl)}, H_kv, D) and v: (S, H_kv, Dv), "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    g = h // hk
    o = torch.zeros(q.shape[0], h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float64)
    tree = None if parents is None else _tree_mask(parents, qsl)
    start = 0
    for b in range(len(sl)):
        t0, t1, n = qsl[b], qsl[b + 1], sl[b]
        nq, ctx = t1 - t0, n - (t1 - t0)
        kb = k[start : start + n].double().cpu()  # (n, H_kv, D): heads read it in groups, not copied per head
        vb = v[start : start + n].double().cpu()
        start += n
        if nq == 0:
            continue
        j = torch.arange(nq)[:, None]
        p = torch.arange(n)[None, :]
        if tree is None:
            mask = p <= ctx + j
        else:
            new = torch.zeros(nq, n, dtype=torch.bool)
            new[:, ctx:] = tree[b, :nq, :nq]
            mask = (p < ctx) | new
        qb = rearrange(q[t0:t1].double().cpu(), "t (k g) d -> k g t d", g=g)
        s = torch.einsum("kgtd,nkd->kgtn", qb, kb) * scale
        s = s.masked_fill(~mask, float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)  # (H_kv, G, nq)
        o[t0:t1] = rearrange(torch.einsum("kgtn,nkd->kgtd", torch.softmax(s, dim=-1), vb), "k g t d -> t (k g) d")
        lse[t0:t1] = rearrange(lse_b, "k g t -> t (k g)")
    return o, lse
