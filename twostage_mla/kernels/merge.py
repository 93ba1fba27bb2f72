"""Triton kernel: merge K attention states, plus an optional extra one, in one pass.

It serves the layer's merges where the query pass is not fused: the a2a combine
fused with the final merge of the query pass (K = N received states + the query
state), and the final merge alone (K = 1 + the query state). Same maths and conventions as
:func:`twostage_mla.state.merge_states`: float32 arithmetic, natural-log lse,
(0, -inf) for empty states (no NaN from them; a NaN lse reaches the output).
Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI checks it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    O_IN, LSE, EO, ELSE, OUT, OUT_LSE,
    K, H, DV,
    so_k, so_t, so_h, sl_k, sl_t, sl_h,
    se_t, se_h, sel_t, sel_h,
    sout_t, sout_h, soutl_t, soutl_h,
    HAS_EXTRA: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # one (token, head) per program
    if WIDE:  # a tensor of >= 2^31 elements: 64-bit offsets (32-bit products would wrap)
        row = row.to(tl.int64)
    t = row // H
    h = row % H
    d = tl.arange(0, BLOCK_D)
    dmask = d < DV

    m = tl.full((), float("-inf"), tl.float32)
    for k32 in range(K):
        k = tl.cast(k32, tl.int64) if WIDE else k32
        m = tl.maximum(m, tl.load(LSE + k * sl_k + t * sl_t + h * sl_h))
    if HAS_EXTRA:
        e_lse = tl.load(ELSE + t * sel_t + h * sel_h)
        m = tl.maximum(m, e_lse)
    # All states empty: shift by 0 so every weight is exp(-inf) = 0, not NaN.
    shift = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros((), tl.float32)
    for k32 in range(K):
        k = tl.cast(k32, tl.int64) if WIDE else k32
        total += tl.exp(tl.load(LSE + k * sl_k + t * sl_t + h * sl_h) - shift)
    if HAS_EXTRA:
        total += tl.exp(e_lse - shift)
    # Normalised weights (they sum to 1): the sum of o * w cannot overflow where every |o| is finite.
    # Tests are "== 0" and "== -inf", never "> 0": a NaN lse must reach the output, not pass as empty.
    safe = tl.where(total == 0, 1.0, total)

    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k32 in range(K):
        k = tl.cast(k32, tl.int64) if WIDE else k32
        lk = tl.load(LSE + k * sl_k + t * sl_t + h * sl_h)
        o = tl.load(O_IN + k * so_k + t * so_t + h * so_h + d, mask=dmask, other=0.0).to(tl.float32)
        acc += tl.where(lk == float("-inf"), 0.0, o * (tl.exp(lk - shift) / safe))  # an empty state's o may be NaN
    if HAS_EXTRA:
        o = tl.load(EO + t * se_t + h * se_h + d, mask=dmask, other=0.0).to(tl.float32)
        acc += tl.where(e_lse == float("-inf"), 0.0, o * (tl.exp(e_lse - shift) / safe))

    lse = tl.where(total == 0, float("-inf"), shift + tl.log(safe))
    tl.store(OUT + t * sout_t + h * sout_h + d, acc.to(OUT.dtype.element_ty), mask=dmask)
    tl.store(OUT_LSE + t * soutl_t + h * soutl_h, lse)


def wide_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element of some tensor lies 2^31 or more elements from its start.

    Triton computes offsets in 32-bit integers where its arguments fit them: past that they
    wrap, so the kernels take 64-bit offsets then (a variant compiled only for such steps).
    """
    # A margin for the masked lanes past a block's end, whose offsets are computed too.
    return max(sum((n - 1) * abs(s) for n, s in zip(x.shape, x.stride()) if n) for x in tensors) >= 2**31 - 2**24


def merge_states_triton(
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`twostage_mla.state.merge_states`.

    o: (K, T, H, Dv) any float dtype, last dim contiguous; lse: (K, T, H) float32.
    extra: optional one more state (o (T, H, Dv), lse (T, H)) merged in the same pass.
    returns o (T, H, Dv) out_dtype (default o's dtype), lse (T, H) float32.
    No host synchronisation; capturable in a CUDA graph.
    """
    k, t, h, dv = o.shape
    if lse.shape != (k, t, h):
        raise ValueError(f"expected lse.shape == (K, T, H) = {(k, t, h)}, got {tuple(lse.shape)}")
    if o.stride(-1) != 1:
        o = o.contiguous()
    lse = lse.float()
    if extra is None and k == 0:  # no states at all: the empty state, as merge_states gives
        o_empty = torch.zeros((t, h, dv), dtype=out_dtype or o.dtype, device=o.device)
        return o_empty, torch.full((t, h), float("-inf"), dtype=torch.float32, device=o.device)
    if extra is None:
        eo, el = o[0], lse[0]  # never read: HAS_EXTRA is False
    else:
        eo, el = extra
        if eo.shape != (t, h, dv) or el.shape != (t, h):
            raise ValueError(
                f"expected extra = (o (T, H, Dv) = {(t, h, dv)}, lse (T, H)), got {tuple(eo.shape)}, {tuple(el.shape)}"
            )
        eo, el = (eo if eo.stride(-1) == 1 else eo.contiguous()), el.float()
    out = torch.empty((t, h, dv), dtype=out_dtype or o.dtype, device=o.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=o.device)
    if t * h:
        _merge_kernel[(t * h,)](
            o, lse, eo, el, out, out_lse,
            k, h, dv,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
            eo.stride(0), eo.stride(1), el.stride(0), el.stride(1),
            out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
            HAS_EXTRA=extra is not None, BLOCK_D=triton.next_power_of_2(dv), WIDE=wide_offsets(o, lse, eo, el, out),
        )  # fmt: skip
    return out, out_lse
