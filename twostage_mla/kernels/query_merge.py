"""Triton kernel: the query pass fused into the final merge.

The query pass is tiny (each token sees at most q_len <= 16 fresh keys of its
own request), so a stock kernel spends more time launching and tiling than
computing. Here one program takes one token and a block of heads sharing a KV
head. It starts an online softmax from the K context states (the N states an
all-to-all delivered, or the one from ag_rs / N = 1), continues it over the
request's visible fresh keys 16 at a time (tensor-core dots), and writes the
output once. Its time is mostly memory latency, not arithmetic, hence the
order of its loads.

Same conventions as :mod:`twostage_mla.state`; visible keys are the causal
prefix of the request, or ``plan.query_mask`` (tree speculation). Runs on
CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI checks it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twostage_mla.plan import StepPlan


@triton.jit
def _query_merge_kernel(
    Q, K, V, REQ, OFF, QSL, MASK, CO, CLSE, OUT, OUT_LSE,
    scale, G, DV, D, NC, NBLK,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sm_b, sm_q,
    sco_k, sco_t, sco_h, scl_k, scl_t, scl_h, so_t, so_h, sol_t, sol_h,
    HAS_MASK: tl.constexpr, HAS_B: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    kvh = tl.program_id(1) // NBLK
    g = (tl.program_id(1) % NBLK) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = g < G
    h = kvh * G + g  # (BLOCK_H,) query heads reading KV head kvh
    da = tl.arange(0, BLOCK_A)  # dims 0 .. Dv-1 (V), of which 0 .. min(D, Dv)-1 also in q and K
    db = DV + tl.arange(0, BLOCK_B)  # dims Dv .. D-1 (K only: MLA's rope part)
    amask = da < DV
    qkmask = (da < DV) & (da < D)
    bmask = db < D

    # The context states are the online softmax's starting point: (acc, den) relative to exp(m).
    # Their loads come first so that they overlap the fresh keys' below (the kernel is latency-bound).
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for c in range(0, NC):
        m = tl.maximum(m, tl.load(CLSE + c * scl_k + t * scl_t + h * scl_h, mask=hmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK_H, BLOCK_A), tl.float32)
    den = tl.zeros((BLOCK_H,), tl.float32)
    for c in range(0, NC):
        w = tl.exp(tl.load(CLSE + c * scl_k + t * scl_t + h * scl_h, mask=hmask, other=float("-inf")) - m_safe)
        o = tl.load(
            CO + c * sco_k + t * sco_t + h[:, None] * sco_h + da[None, :],
            mask=hmask[:, None] & amask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.where(w[:, None] > 0, o * w[:, None], 0.0)  # an empty state's o may be NaN
        den += w

    # A request's tokens are contiguous, so token t = start + j sits j rows into its request.
    j = tl.load(OFF + t)
    start = t - j
    if HAS_MASK:
        b = tl.load(REQ + t)
        n_keys = tl.load(QSL + b + 1) - start  # the whole request; the mask picks
    else:
        n_keys = j + 1  # causal: keys 0 .. j of the request
    qa = tl.load(Q + t * sq_t + h[:, None] * sq_h + da[None, :], mask=hmask[:, None] & qkmask[None, :], other=0.0)
    if HAS_B:
        qb = tl.load(Q + t * sq_t + h[:, None] * sq_h + db[None, :], mask=hmask[:, None] & bmask[None, :], other=0.0)
    if DOT_F32:
        qa = qa.to(tl.float32)
        if HAS_B:
            qb = qb.to(tl.float32)
    for n0 in range(0, n_keys, BLOCK_N):
        i = n0 + tl.arange(0, BLOCK_N)
        kmask = i < n_keys
        rows = start + i
        ka = tl.load(K + rows[:, None] * sk_t + kvh * sk_h + da[None, :], mask=kmask[:, None] & qkmask[None, :],
                     other=0.0)  # fmt: skip
        if DOT_F32:
            ka = ka.to(tl.float32)
        s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        if HAS_B:
            kb = tl.load(K + rows[:, None] * sk_t + kvh * sk_h + db[None, :], mask=kmask[:, None] & bmask[None, :],
                         other=0.0)  # fmt: skip
            if DOT_F32:
                kb = kb.to(tl.float32)
            s += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        s = s * scale
        valid = kmask
        if HAS_MASK:
            valid = valid & (tl.load(MASK + b * sm_b + j * sm_q + i, mask=kmask, other=0) != 0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - safe)
        p = tl.exp(s - safe[:, None])
        v = tl.load(V + rows[:, None] * sv_t + kvh * sv_h + da[None, :], mask=kmask[:, None] & amask[None, :],
                    other=0.0)  # fmt: skip
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        den = den * alpha + tl.sum(p, axis=1)
        m = m_new
    # Every token sees itself, so den > 0.
    out = (acc / den[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + t * so_t + h[:, None] * so_h + da[None, :], out, mask=hmask[:, None] & amask[None, :])
    tl.store(OUT_LSE + t * sol_t + h * sol_h, m + tl.log(den), mask=hmask)


def query_merge_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: StepPlan,
    ctx_o: torch.Tensor,
    ctx_lse: torch.Tensor,
    *,
    scale: float,
    out_dtype: torch.dtype,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (or tree-masked) attention over the fresh K/V, merged with context states.

    q: (T, H, D); k: (T, H_kv, D); v: (T, H_kv, Dv) (may be a view of k).
        Query head h reads KV head h // (H / H_kv).
    plan: the step's plan (token -> request, offsets, query_start_loc, query_mask).
    ctx_o: (K, T, H, Dv) any float dtype; ctx_lse: (K, T, H) float32 — the
        context states to merge (K >= 0).
    returns o (T, H, Dv) out_dtype, lse (T, H) float32.
    block_h, num_warps: launch shape (heads per program, warps per program);
        None picks the default (benchmarks/query_merge_sweep.py measures them).
    No host synchronisation; capturable in a CUDA graph.
    """
    t, h, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    q, k, v, ctx_o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, ctx_o))
    if ctx_o.shape[1:] != (t, h, dv) or ctx_lse.shape != ctx_o.shape[:3]:
        raise ValueError(
            f"expected ctx_o: (K, T, H, Dv) = (K, {t}, {h}, {dv}) and ctx_lse: (K, T, H), "
            f"got {tuple(ctx_o.shape)} and {tuple(ctx_lse.shape)}"
        )
    g = h // hk
    # tl.dot needs blocks of >= 16 rows and columns: fewer heads or dims are padded (masked).
    # Measured on H200s (benchmarks/query_merge_sweep.py): 16 heads per program, or 32 from 64 heads on
    # (28.0 vs 30.1 us at 128). Rejected after measuring (benchmarks/results/): splitting the value dims
    # over programs (each slice recomputes the scores: 10.8 vs 6.5 us at 16 heads), and loading the
    # fresh keys before the token's offset with a programmatic dependent launch (no faster in the layer,
    # and twice as slow with two context states at 128 heads: more live registers).
    block_h = block_h or (32 if g >= 64 else 16)
    nblk = triton.cdiv(g, block_h)
    out = torch.empty((t, h, dv), dtype=out_dtype, device=q.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    mask = plan.query_mask
    has_mask = mask is not None
    if not has_mask:
        mask = plan.query_start_loc  # never read
    sm = mask.stride() if has_mask else (0, 0, 0)
    ctx_lse = ctx_lse.float()
    if t:
        _query_merge_kernel[(t, hk * nblk)](
            q, k, v, plan.token_request, plan.token_offset, plan.query_start_loc, mask, ctx_o, ctx_lse, out, out_lse,
            scale, g, dv, d, ctx_o.shape[0], nblk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), sm[0], sm[1],
            ctx_o.stride(0), ctx_o.stride(1), ctx_o.stride(2), ctx_lse.stride(0), ctx_lse.stride(1), ctx_lse.stride(2),
            out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
            HAS_MASK=has_mask, HAS_B=d > dv, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            # Triton's interpreter multiplies bf16 dot operands as raw bits (triton-lang/triton#11584): upcast there.
            DOT_F32=q.device.type == "cpu",
            BLOCK_H=block_h, BLOCK_N=16, BLOCK_A=max(16, triton.next_power_of_2(dv)),
            BLOCK_B=max(16, triton.next_power_of_2(d - dv)), num_warps=num_warps or 4,
        )  # fmt: skip
    return out, out_lse
