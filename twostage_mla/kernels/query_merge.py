"""Triton kernel: the query pass fused into the final merge.

The query pass is tiny (each token sees at most q_len <= 16 fresh keys of its
own request), so a stock kernel spends more time launching and tiling than
computing. Here one program takes one token and a block of heads sharing a KV
head. In two passes: the softmax's max and denominator over the K context
states (the N states an all-to-all delivered, or the one from ag_rs / N = 1,
each one "key" of weight exp(lse)) and the request's visible fresh keys, 16 at
a time, scores from the head dim in chunks (tensor-core dots); then each chunk
of the value dims is written once: the context states' share plus the fresh
keys' (the scores of a request of up to 16 tokens are kept, not recomputed).
No (heads x D) tile sits in registers, so many programs fit on an SM: the
kernel waits on memory more than on anything else, so the value chunks are
software-pipelined. Requests of more than 16 tokens (chunked prefill) take a
variant with extra loops over their keys, compiled only where a plan has them.

Same conventions as :mod:`twostage_mla.state`; visible keys are the causal
prefix of the request, or ``plan.query_mask`` (tree speculation). Runs on
CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI checks it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from twostage_mla.kernels.merge import wide_offsets
from twostage_mla.plan import StepPlan

# The default launch shapes as the kernel's constexprs: narrow (value dims in one chunk) below 64 query
# heads per KV head, and from 64 on for steps so small that the wide launch would have at most
# _FEW_PROGRAMS programs; wide otherwise. Why these, in query_merge_triton. tests/compile_kernels.py
# compiles both.
_NARROW_LAUNCH = dict(BLOCK_H=16, BLOCK_D=128)
_WIDE_LAUNCH = dict(BLOCK_H=32, BLOCK_D=64, BLOCK_V=128)
_FEW_PROGRAMS = 128


def _wide_launch(t: int, hk: int, g: int) -> bool:
    """Whether T tokens of H_kv KV heads with g query heads each take the wide default launch."""
    return g >= 64 and t * hk * triton.cdiv(g, _WIDE_LAUNCH["BLOCK_H"]) > _FEW_PROGRAMS


@triton.jit
def _key_block(
    Q, K, MASK, t, h, hmask, kvh, start, j, b, n0, n_keys, D, scale, sq_t, sq_h, sk_t, sk_h, sm_b, sm_q,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Scaled scores of fresh keys n0 .. n0+BLOCK_N-1 of the request, -inf where not visible; their rows; visible.

    The head dim is read in chunks so that no (heads x D) tile sits in registers
    (with whole tiles the kernel ran at ~40 % of the copy bandwidth at 128 heads;
    in chunks, with 64 heads per program, 25.5 instead of 28.6 us there).
    """
    i = n0 + tl.arange(0, BLOCK_N)
    kmask = i < n_keys
    rows = start + i
    s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        qc = tl.load(Q + t * sq_t + h[:, None] * sq_h + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
        kc = tl.load(K + rows[:, None] * sk_t + kvh * sk_h + d[None, :], mask=kmask[:, None] & dmask[None, :],
                     other=0.0)  # fmt: skip
        if DOT_F32:
            qc, kc = qc.to(tl.float32), kc.to(tl.float32)
        s += tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    valid = kmask
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * sm_b + j * sm_q + i, mask=kmask, other=0) != 0)
    # The visible keys, for the value loads too: an invisible key's weight is 0, but 0 * NaN is not
    # (a later token of the request, or a tree sibling, may hold garbage such as graph padding).
    return tl.where(valid[None, :], s * scale, float("-inf")), rows, valid


@triton.jit
def _context_chunk(
    CO, CLSE, t, h, hmask, v0, m_c, NC, DV, sco_k, sco_t, sco_h, scl_k, scl_t, scl_h,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Sum over the context states of exp(lse - m_c) * o, value dims v0 .. v0+BLOCK_V-1."""
    dv = v0 + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    for c32 in range(0, NC):
        c = tl.cast(c32, tl.int64) if WIDE else c32
        lse = tl.load(CLSE + c * scl_k + t * scl_t + h * scl_h, mask=hmask, other=float("-inf"))
        o = tl.load(
            CO + c * sco_k + t * sco_t + h[:, None] * sco_h + dv[None, :],
            mask=hmask[:, None] & (dv < DV)[None, :],
            other=0.0,
        ).to(tl.float32)
        # An empty state's o may be NaN: left out. A NaN lse is not empty: it reaches the output.
        acc += tl.where((lse == float("-inf"))[:, None], 0.0, o * tl.exp(lse - m_c)[:, None])
    return acc


@triton.jit
def _softmax_stats(m, den, s):
    """Running max and denominator (relative to exp(max)) after one more block of scores s."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: keep den = 0, not NaN
    return m_new, den * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)


@triton.jit
def _query_merge_kernel(
    Q, K, V, REQ, OFF, QSL, MASK, CO, CLSE, OUT, OUT_LSE,
    scale, G, DV, D, NC, NBLK,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sm_b, sm_q,
    sco_k, sco_t, sco_h, scl_k, scl_t, scl_h, so_t, so_h, sol_t, sol_h,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    LONG: tl.constexpr, V_STAGES: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    if WIDE:  # a tensor of >= 2^31 elements: 64-bit offsets (32-bit products would wrap)
        t = t.to(tl.int64)
    kvh = tl.program_id(1) // NBLK
    g = (tl.program_id(1) % NBLK) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = g < G
    h = kvh * G + g  # (BLOCK_H,) query heads reading KV head kvh

    # A request's tokens are contiguous, so token t = start + j sits j rows into its request.
    j = tl.load(OFF + t)
    start = t - j
    b = 0
    if HAS_MASK:
        b = tl.load(REQ + t)
        n_keys = tl.load(QSL + b + 1) - start  # the whole request; the mask picks
    else:
        n_keys = j + 1  # causal: keys 0 .. j of the request

    # Two passes, as the value dims come in chunks: first the softmax's max m and
    # denominator den over the context states (each one key of weight exp(lse))
    # and the fresh keys, then each chunk of the output in one go. The context
    # states' share of a chunk is summed relative to their own max m_c.
    m_c = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for c32 in range(0, NC):
        c = tl.cast(c32, tl.int64) if WIDE else c32
        m_c = tl.maximum(m_c, tl.load(CLSE + c * scl_k + t * scl_t + h * scl_h, mask=hmask, other=float("-inf")))
    m_c = tl.where(m_c == float("-inf"), 0.0, m_c)  # no context: every weight below is 0
    den = tl.zeros((BLOCK_H,), tl.float32)
    for c32 in range(0, NC):
        c = tl.cast(c32, tl.int64) if WIDE else c32
        den += tl.exp(tl.load(CLSE + c * scl_k + t * scl_t + h * scl_h, mask=hmask, other=float("-inf")) - m_c)
    # Keys 0 .. BLOCK_N-1 hold every key of a request of up to BLOCK_N tokens: keep their scores.
    s0, rows0, seen0 = _key_block(
        Q, K, MASK, t, h, hmask, kvh, start, j, b, 0, n_keys, D, scale, sq_t, sq_h, sk_t, sk_h, sm_b, sm_q,
        HAS_MASK, PRECISION, DOT_F32, BLOCK_H, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    has_ctx = den != 0  # not "> 0": a NaN context lse must reach the output, not drop the context
    m, den = _softmax_stats(tl.where(has_ctx, m_c, float("-inf")), den, s0)
    # Requests of more than BLOCK_N tokens. Compiled only where a request may have them: the
    # loops, even when they never run, cost the value loop its pipelining (21.7 vs 17.7 us).
    if LONG:
        for n0 in range(BLOCK_N, n_keys, BLOCK_N):
            s, _, _ = _key_block(
                Q, K, MASK, t, h, hmask, kvh, start, j, b, n0, n_keys, D, scale, sq_t, sq_h, sk_t, sk_h, sm_b, sm_q,
                HAS_MASK, PRECISION, DOT_F32, BLOCK_H, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            m, den = _softmax_stats(m, den, s)
    # Every token sees itself, so m is finite and den > 0 from here on; m >= m_c where a context exists.
    p0 = tl.exp(s0 - m[:, None])
    inv = 1.0 / den
    fix = tl.exp(tl.where(has_ctx, m_c - m, float("-inf"))) * inv  # context share: from m_c to m, normalised
    # Software-pipelined: the context states of the next chunks load while this one is summed.
    for v0 in tl.range(0, DV, BLOCK_V, num_stages=V_STAGES):
        dv = v0 + tl.arange(0, BLOCK_V)
        vmask = dv < DV
        ctx = _context_chunk(
            CO, CLSE, t, h, hmask, v0, m_c, NC, DV, sco_k, sco_t, sco_h, scl_k, scl_t, scl_h, BLOCK_H, BLOCK_V, WIDE
        )  # fmt: skip
        acc = ctx * fix[:, None]
        v = tl.load(V + rows0[:, None] * sv_t + kvh * sv_h + dv[None, :], mask=seen0[:, None] & vmask[None, :],
                    other=0.0)  # fmt: skip
        if DOT_F32:
            v = v.to(tl.float32)
        fresh = tl.dot(p0.to(v.dtype), v, input_precision=PRECISION)
        if LONG:  # requests of more than BLOCK_N tokens: their scores again
            for n0 in range(BLOCK_N, n_keys, BLOCK_N):
                s, rows, seen = _key_block(
                    Q, K, MASK, t, h, hmask, kvh, start, j, b, n0, n_keys, D, scale, sq_t, sq_h, sk_t, sk_h, sm_b,
                    sm_q, HAS_MASK, PRECISION, DOT_F32, BLOCK_H, BLOCK_N, BLOCK_D,
                )  # fmt: skip
                v = tl.load(V + rows[:, None] * sv_t + kvh * sv_h + dv[None, :],
                            mask=seen[:, None] & vmask[None, :], other=0.0)  # fmt: skip
                if DOT_F32:
                    v = v.to(tl.float32)
                fresh += tl.dot(tl.exp(s - m[:, None]).to(v.dtype), v, input_precision=PRECISION)
        out = (acc + fresh * inv[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + t * so_t + h[:, None] * so_h + dv[None, :], out, mask=hmask[:, None] & vmask[None, :])
    tl.store(OUT_LSE + t * sol_t + h * sol_h, m + tl.log(den), mask=hmask)


def _check_launch_shape(block_h, block_d, block_v, num_warps, v_stages) -> None:
    """Raise unless each value given (not None) is a power of two >= 16 (blocks), >= 1 (warps), or >= 1 (stages)."""
    for name, x, lo in (("block_h", block_h, 16), ("block_d", block_d, 16), ("block_v", block_v, 16),
                        ("num_warps", num_warps, 1), ("v_stages", v_stages, 1)):  # fmt: skip
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, int) or x < lo or (name != "v_stages" and x & (x - 1)):
            what = ">= 1" if name == "v_stages" else f"a power of two >= {lo}"
            raise ValueError(f"expected {name} {what}, got {x!r}")


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
    block_d: int | None = None,
    block_v: int | None = None,
    v_stages: int | None = None,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (or tree-masked) attention over the fresh K/V, merged with context states.

    q: (T, H, D); k: (T, H_kv, D); v: (T, H_kv, Dv) (may be a view of k).
        Query head h reads KV head h // (H / H_kv).
    plan: the step's plan (token -> request, offsets, query_start_loc, query_mask).
    ctx_o: (K, T, H, Dv) any float dtype; ctx_lse: (K, T, H) float32 — the
        context states to merge (K >= 0).
    returns o (T, H, Dv) out_dtype, lse (T, H) float32.
    block_h, num_warps, block_d, block_v, v_stages: launch shape (heads and
        warps per program, chunks of the head dim for the scores and of the
        value dim for the output, powers of two >= 16; value chunks in flight
        at once); None picks the default (benchmarks/query_merge_sweep.py
        measures them). Where the GPU has too little shared memory for the
        default pipelining, the kernel runs without it; chosen v_stages that
        do not fit raise Triton's OutOfResources.
    max_q_len: the most tokens of one request the launch serves; None:
        plan.max_q_len. A CUDA graph replayed after other plans needs the most
        of any of them (requests of more than 16 tokens take a slower variant).
    No host synchronisation; capturable in a CUDA graph.
    """
    t, h, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    # The kernel indexes with the plan's per-token indices and h // (H / H_kv): a mismatch would read
    # out of bounds or leave heads unwritten, so it is refused here.
    if t != plan.num_tokens or k.shape != (t, hk, d) or v.shape != (t, hk, dv) or hk < 1 or h % hk:
        raise ValueError(
            f"expected q: (T, H, D), k: (T, H_kv, D), v: (T, H_kv, Dv) with T = plan.num_tokens = "
            f"{plan.num_tokens} and H a multiple of H_kv, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    q, k, v, ctx_o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, ctx_o))
    if ctx_o.shape[1:] != (t, h, dv) or ctx_lse.shape != ctx_o.shape[:3]:
        raise ValueError(
            f"expected ctx_o: (K, T, H, Dv) = (K, {t}, {h}, {dv}) and ctx_lse: (K, T, H), "
            f"got {tuple(ctx_o.shape)} and {tuple(ctx_lse.shape)}"
        )
    g = h // hk
    # tl.dot needs blocks of >= 16 rows and columns: fewer heads or dims are padded (masked).
    # Defaults measured on H200s, the heads a program from 64 per KV head also on H100s (below;
    # benchmarks/query_merge_sweep.py, docs/performance.md): below 64 heads per KV head, 16 heads
    # per program and the value dims in one chunk; from 64 on, 32 heads, value chunks of 128, three
    # in flight with one context state and two with more (their tiles share the shared memory). At
    # 128 heads, B = 32, Q = 4, then with 64 heads a program: 17.8 vs 22.2 us for the kernel without
    # pipelining with one state; 27.8 (two in flight) vs 29.8 (three) vs 30.3 with two states.
    # 32 heads a program rather than 64 (session 55, 64 and 128 heads, Q = 1 - 16, nine rounds on
    # H100s): 12 - 17 % faster at Q = 1 and at Q = 2 with 64 heads (more programs for few tokens),
    # 0 - 5 % with two states from Q = 2, -1 to +5 % with one; on an H200 at Q = 4 and 8, 128
    # heads, -3 % with two states, level with one.
    # The narrow launch from 64 heads too where the wide one has <= 128 programs (under one per SM of
    # an H100 or H200; session 57, H100, 64 and 128 heads, B = 8 - 128, Q = 1 and 2, three rounds):
    # 21 - 37 % faster with <= 64 wide programs, 0.88 - 1.02x at 128; 1.12 - 1.48x slower from 256.
    # Rejected after measuring (benchmarks/results/): value dims split over programs (each
    # recomputes the scores), fresh keys loaded ahead with a programmatic dependent launch, the
    # next chunk loaded ahead by hand (two live tiles in registers), a softmax launch then a
    # streaming merge launch (20.4 vs 17.7 us with one state, 27.3 vs 28.5 with two: not worth a
    # second kernel).
    wide = _wide_launch(t, hk, g)
    whole_v = max(16, triton.next_power_of_2(dv))
    chosen_stages = v_stages is not None
    chosen = (block_h, block_d, block_v, num_warps, v_stages)
    if chosen != (None,) * 5:  # a caller's launch shape (a sweep); the defaults below are valid, so the layer's
        _check_launch_shape(*chosen)  # per-call path skips the check (~1 us of host time a layer)
    # `is None`, not `or`: a 0 given by a caller must be refused above, not run as the default.
    default = _WIDE_LAUNCH if wide else _NARROW_LAUNCH
    block_h = default["BLOCK_H"] if block_h is None else block_h
    block_d = default["BLOCK_D"] if block_d is None else block_d
    block_v = min(default.get("BLOCK_V", whole_v), whole_v) if block_v is None else block_v
    v_stages = (3 if wide and ctx_o.shape[0] == 1 else 2) if v_stages is None else v_stages
    num_warps = 4 if num_warps is None else num_warps
    max_q_len = plan.max_q_len if max_q_len is None else max_q_len
    if max_q_len < plan.max_q_len:  # the short variant would drop keys past the 16th
        raise ValueError(f"expected max_q_len >= {plan.max_q_len} (the plan's longest request), got {max_q_len}")
    nblk = triton.cdiv(g, block_h)
    out = torch.empty((t, h, dv), dtype=out_dtype, device=q.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    mask = plan.query_mask
    has_mask = mask is not None
    if has_mask:
        b, w = plan.query_start_loc.shape[0] - 1, plan.max_q_len
        if mask.dim() != 3 or mask.shape[0] < b or min(mask.shape[1:]) < w or mask.stride(2) != 1:
            raise ValueError(
                f"expected plan.query_mask: (B, W, W) = (>= {b}, >= {w}, >= {w}) bool with its last dim contiguous, "
                f"got shape {tuple(mask.shape)}, strides {mask.stride()}"
            )
    else:
        mask = plan.query_start_loc  # never read
    sm = mask.stride() if has_mask else (0, 0, 0)
    ctx_lse = ctx_lse.float()
    if not t:
        return out, out_lse
    args = (
        q, k, v, plan.token_request, plan.token_offset, plan.query_start_loc, mask, ctx_o, ctx_lse, out, out_lse,
        scale, g, dv, d, ctx_o.shape[0], nblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), sm[0], sm[1],
        ctx_o.stride(0), ctx_o.stride(1), ctx_o.stride(2), ctx_lse.stride(0), ctx_lse.stride(1), ctx_lse.stride(2),
        out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
    )  # fmt: skip
    meta = dict(
        HAS_MASK=has_mask, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bf16 dot operands as raw bits (triton-lang/triton#11584): upcast there.
        DOT_F32=q.device.type == "cpu",
        BLOCK_H=block_h, BLOCK_N=16, BLOCK_D=block_d, BLOCK_V=block_v, LONG=max_q_len > 16, num_warps=num_warps,
        WIDE=wide_offsets(q, k, v, mask, ctx_o, ctx_lse, out, out_lse),
    )  # fmt: skip
    try:
        _launch((t, hk * nblk), args, meta, v_stages=v_stages, num_stages=4)
    except OutOfResources:
        if chosen_stages:  # the caller's launch shape: say so rather than run another one
            raise
        # The default stages were measured on H200s; a GPU with less shared memory runs without.
        _launch((t, hk * nblk), args, meta, v_stages=1, num_stages=1)
    return out, out_lse


def _launch(grid: tuple[int, int], args: tuple, meta: dict, *, v_stages: int, num_stages: int) -> None:
    _query_merge_kernel[grid](*args, **meta, V_STAGES=v_stages, num_stages=num_stages)
