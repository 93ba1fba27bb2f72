"""CPU stand-ins for the GPU kernels, following each one's documented contract.

Used by test_backends_emulated.py to run the fast backends' glue (index
building, views, lse layouts and bases, empty rows, plan/run state) on a
machine without a GPU. Each stand-in computes exact attention in float64 and
returns it the way the real kernel does: lse layout and base, and what it
writes for rows with no keys (the worst documented case, so the backend's
normalisation is exercised). They check the arguments the real kernels
check (dtypes of index tensors, shapes, plan before run).
"""

from __future__ import annotations

import dataclasses
import math
import types

import torch

LOG2E = 1.0 / math.log(2.0)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    qv: torch.Tensor | None = None,
    kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (M, H, D), k (N, Hk, D), v (N, Hk, Dv), mask (M, N) or (H, M, N) -> o (M, H, Dv), lse (M, H) float64.

    lse in natural log.

    qv/kv: an extra score term qv . kv (FA3's qv form, FlashInfer's q_nope . ckv).
    Rows with no visible key: o = 0, lse = -inf.
    """
    h, hk = q.shape[1], k.shape[1]
    g = h // hk
    mask = mask if mask.dim() == 3 else mask[None]  # (M, N) for every head, or (H, M, N)
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk)
    if qv is not None:
        s = s + torch.einsum("mhd,nhd->hmn", qv.double(), kv.double().repeat_interleave(g, dim=1))
    s = (s * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, M)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    o = torch.einsum("hmn,nhd->mhd", p, vv)
    return o, lse.T


def _bottom_right(m: int, n: int, causal: bool) -> torch.Tensor:
    i = torch.arange(m)[:, None]
    j = torch.arange(n)[None, :]
    return (j <= i + (n - m)) if causal else torch.ones(m, n, dtype=torch.bool)


def _paged(cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    """The first ``length`` tokens of a request from its pages: (length, ...)."""
    if not pages:
        return cache.new_zeros((0, *cache.shape[2:]))
    return torch.cat([cache[p] for p in pages])[:length]


def _latch_rows(wrapper, qo_indptr) -> None:
    """FlashInfer 0.5.3's prefill wrappers in CUDA-graph mode fix their row count at the first plan
    (flashinfer/prefill.py, plan(): "The total number of rows in qo_indptr ... cannot exceed ...")."""
    rows = int(qo_indptr[-1])
    if getattr(wrapper, "_max_rows", None) is None:
        wrapper._max_rows = rows
    elif rows > wrapper._max_rows:
        raise ValueError(f"The total number of rows in qo_indptr {rows} in cuda graph mode cannot exceed the "
                         f"number of rows set during initialization {wrapper._max_rows}.")  # fmt: skip


def _unit_stride(*ts: torch.Tensor | None) -> None:
    """The real kernels read a head's values with stride 1 (their checks refuse other strides)."""
    assert all(t is None or t.stride(-1) == 1 for t in ts), [t.stride() for t in ts if t is not None]


def _check_i32(**ts: torch.Tensor) -> None:
    for name, t in ts.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")


# -- torch's aten ops ------------------------------------------------------------


def efficient_attention_forward(
    q,
    k,
    v,
    bias,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    mask_type,
    compute_lse,
    *,
    scale=None,
    seqlen_k=None,
    window_size=None,
):
    """aten._efficient_attention_forward: (1, M, H, D) varlen; lse (B, H, ceil(max_q/32)*32)."""
    assert q.dim() == 4 and q.shape[0] == 1 and bias is None and dropout_p == 0.0
    assert k.shape[2] == q.shape[2] == v.shape[2], "the kernel wants as many K/V heads as query heads"
    assert q.shape[-1] == k.shape[-1] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    _check_i32(cu_q=cu_q, cu_k=cu_k)
    b, h, dv = cu_q.numel() - 1, q.shape[2], v.shape[-1]
    o = torch.full((1, q.shape[1], h, dv), float("nan"), dtype=torch.float64)
    lse = torch.full((b, h, -(-max_q // 32) * 32), 123.0, dtype=torch.float32)  # padding: garbage
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(b):
        m, n = cq[r + 1] - cq[r], ck[r + 1] - ck[r]
        assert m <= max_q and n <= max_k
        top_left = torch.arange(n)[None] <= torch.arange(m)[:, None]
        mask = torch.ones(m, n, dtype=torch.bool) if mask_type == 0 else top_left
        ob, lb = attend(q[0, cq[r] : cq[r + 1]], k[0, ck[r] : ck[r + 1]], v[0, ck[r] : ck[r + 1]], mask, scale)
        empty = torch.isneginf(lb)
        o[0, cq[r] : cq[r + 1]] = ob.masked_fill(empty[..., None], float("nan"))  # rows with no keys: garbage
        lse[r, :, :m] = lb.T.masked_fill(empty.T, 0.0).float()  # mem-efficient writes lse = 0 there
    return o.to(q.dtype), lse, torch.tensor(0), torch.tensor(0), max_q, max_k


def flash_attention_forward(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    """aten._flash_attention_forward varlen: lse (H, T), +inf for rows with no keys, o = 0 there."""
    _unit_stride(q, k, v)
    assert q.dim() == 3 and dropout_p == 0.0
    assert q.shape[-1] == v.shape[-1] <= 256
    _check_i32(cu_q=cu_q, cu_k=cu_k)
    t, h = q.shape[:2]
    o = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(h, t, dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(cu_q.numel() - 1):
        m = cq[r + 1] - cq[r]
        if block_table is not None:
            n = int(seqused_k[r])
            npg = -(-n // k.shape[1])
            kb = _paged(k, block_table[r, :npg].tolist(), n)
            vb = _paged(v, block_table[r, :npg].tolist(), n)
        else:
            n = ck[r + 1] - ck[r]
            kb, vb = k[ck[r] : ck[r + 1]], v[ck[r] : ck[r + 1]]
        assert m <= max_q and n <= max_k
        ob, lb = attend(q[cq[r] : cq[r + 1]], kb, vb, _bottom_right(m, n, is_causal), scale)
        o[cq[r] : cq[r + 1]] = ob
        lse[:, cq[r] : cq[r + 1]] = torch.where(torch.isneginf(lb), float("inf"), lb).T.float()
    return o.to(q.dtype), lse, torch.empty(2), torch.empty(0), torch.empty(0)


# -- FlashInfer ------------------------------------------------------------------


def fa3_mla_causal_mask(m: int, n: int, h: int, tile: int) -> torch.Tensor:
    """The keys FlashInfer 0.5.3's sm90 causal MLA kernel lets each (head, query) row see: (h, m, n) bool.

    Measured on an H200 (benchmarks/fi_mla_causal_probe.py): a tile of ``tile`` packed rows (query x
    head; 128 where the batch averages over 64 per request, else 64) reads key tiles of 64 up to
    floor((start + tile) / h) past the context, not the ceiling: where h does not divide start + tile
    and that bound opens a new key tile, the tile's last query loses its own key.
    """
    row = torch.arange(m * h).reshape(m, h)
    bound = torch.clamp(n - m + (row // tile * tile + tile) // h, max=n)
    read = torch.arange(n)[None, None, :] < ((bound + 63) // 64 * 64)[..., None]  # (m, h, n)
    return (_bottom_right(m, n, True)[:, None, :] & read).permute(1, 0, 2)


class _MLAWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper: plan stores metadata, run reads it."""

    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        # The backend pins the kernels whose tiling it models; FlashInfer's "auto" may pick others.
        assert backend in ("fa2", "fa3"), f"expected backend 'fa2' or 'fa3', got {backend!r}"
        self.backend = backend
        self._graph = use_cuda_graph
        self._bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._planned = False

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        use_profiler=False,
    ):
        _check_i32(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        if self._graph:
            qo, kp, ki, kl = self._bufs
            qo.copy_(qo_indptr)  # as FlashInfer: the sizes must match the buffers
            kp.copy_(kv_indptr)
            ki[: len(kv_indices)].copy_(kv_indices)
            kl.copy_(kv_len_arr)
        else:
            self._bufs = (qo_indptr.clone(), kv_indptr.clone(), kv_indices.clone(), kv_len_arr.clone())
        self._meta = (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type)
        self._planned = True

    def run(
        self,
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        out=None,
        lse=None,
        return_lse=False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e=False,
    ):
        _unit_stride(q_nope, q_pe, ckv_cache, kpe_cache)
        assert self._planned, "run before plan"
        h, dckv, dkpe, ps, causal, scale, qdt = self._meta
        assert q_nope.shape[1:] == (h, dckv) and q_pe.shape[1:] == (h, dkpe) and q_nope.dtype == qdt
        assert ckv_cache.dim() == 3 and kpe_cache.dim() == 3 and ckv_cache.shape[1] == ps
        assert out is not None and out.shape == q_nope.shape and lse is not None and lse.shape == q_nope.shape[:2]
        qo, kp, ki, kl = (b.tolist() for b in self._bufs)
        tile = 128 if qo[-1] * h // (len(qo) - 1) > 64 else 64
        for r in range(len(qo) - 1):
            m, n = qo[r + 1] - qo[r], kl[r]
            pages = ki[kp[r] : kp[r + 1]]
            kb = _paged(kpe_cache, pages, n)[:, None]
            cb = _paged(ckv_cache, pages, n)[:, None]
            mask = fa3_mla_causal_mask(m, n, h, tile) if causal else _bottom_right(m, n, False)
            ob, lb = attend(q_pe[qo[r] : qo[r + 1]], kb, cb, mask, scale, qv=q_nope[qo[r] : qo[r + 1]], kv=cb)
            out[qo[r] : qo[r + 1]] = ob.to(out.dtype)
            # No keys: the fa3 kernel leaves m at its finite "-inf" (-5e4, log2), seen on an H200.
            lb = torch.where(torch.isneginf(lb), -5e4 / LOG2E, lb)
            lse[qo[r] : qo[r + 1]] = (lb if return_lse_base_on_e else lb * LOG2E).float()
        return (out, lse) if return_lse else out


class _PagedPrefillWrapper:
    """flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper (NHD): lse in log2."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        **kw,
    ):
        assert kv_layout == "NHD"
        self._graph = use_cuda_graph
        self._bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
        **kw,
    ):
        _check_i32(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
        )
        if self._graph:
            _latch_rows(self, qo_indptr)
            qo, kp, ki, kl = self._bufs
            qo.copy_(qo_indptr)
            kp.copy_(paged_kv_indptr)
            ki[: len(paged_kv_indices)].copy_(paged_kv_indices)
            kl.copy_(paged_kv_last_page_len)
        else:
            meta = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            self._bufs = tuple(x.clone() for x in meta)
        self._meta = (num_qo_heads, num_kv_heads, page_size, causal, sm_scale)

    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False, **kw):
        k_cache, v_cache = paged_kv_cache
        _unit_stride(q, k_cache, v_cache)
        h, hk, ps, causal, scale = self._meta
        assert q.shape[1] == h and k_cache.shape[1:3] == (ps, hk)
        qo, kp, ki, kl = (b.tolist() for b in self._bufs)
        out = out if out is not None else q.new_empty((*q.shape[:2], v_cache.shape[-1]))
        lse = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32)
        for r in range(len(qo) - 1):
            m, npg = qo[r + 1] - qo[r], kp[r + 1] - kp[r]
            n = max(npg - 1, 0) * ps + kl[r]
            pages = ki[kp[r] : kp[r + 1]]
            ob, lb = attend(
                q[qo[r] : qo[r + 1]],
                _paged(k_cache, pages, n),
                _paged(v_cache, pages, n),
                _bottom_right(m, n, causal),
                scale,
            )
            empty = torch.isneginf(lb)
            out[qo[r] : qo[r + 1]] = ob.masked_fill(empty[..., None], float("nan")).to(out.dtype)  # worst case
            lse[qo[r] : qo[r + 1]] = (lb * LOG2E).masked_fill(empty, float("inf")).float()
        return (out, lse) if return_lse else out


class _RaggedPrefillWrapper:
    """flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper (NHD): lse in log2."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        kv_indptr_buf=None,
        **kw,
    ):
        self._graph = use_cuda_graph
        self._bufs = (qo_indptr_buf, kv_indptr_buf)

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
        **kw,
    ):
        _check_i32(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        if self._graph:
            _latch_rows(self, qo_indptr)
            self._bufs[0].copy_(qo_indptr)
            self._bufs[1].copy_(kv_indptr)
        else:
            self._bufs = (qo_indptr.clone(), kv_indptr.clone())
        self._meta = (num_qo_heads, num_kv_heads, causal, sm_scale)

    def run(self, q, k, v, *args, out=None, lse=None, return_lse=False, **kw):
        _unit_stride(q, k, v)
        h, hk, causal, scale = self._meta
        assert q.shape[1] == h and k.shape[1] == hk
        qo, kp = (b.tolist() for b in self._bufs)
        for r in range(len(qo) - 1):
            m, n = qo[r + 1] - qo[r], kp[r + 1] - kp[r]
            ob, lb = attend(
                q[qo[r] : qo[r + 1]], k[kp[r] : kp[r + 1]], v[kp[r] : kp[r + 1]], _bottom_right(m, n, causal), scale
            )
            out[qo[r] : qo[r + 1]] = ob.to(out.dtype)
            lse[qo[r] : qo[r + 1]] = (lb * LOG2E).float()
        return (out, lse) if return_lse else out


@dataclasses.dataclass
class _MLAPlanMetadata:
    """flashinfer.mla.MLAPlanMetadata (0.7.4): the CSR form only."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class _MLAWrapperKeywords(_MLAWrapper):
    """The MLA wrapper of FlashInfer 0.7.4: keywords, a metadata object and the lse mode at plan time; the
    0.5.3 forms it still takes (with a DeprecationWarning) are refused here, so the backend must not use them."""

    def plan(self, *args, metadata, query_layout, kv_cache_layout, lse_mode, **shape):
        assert not args, "positional plan() arguments: deprecated in FlashInfer 0.7"
        assert isinstance(metadata, _MLAPlanMetadata) and (query_layout, kv_cache_layout) == ("split", "split")
        self._lse_mode = lse_mode
        m = metadata
        if self._graph:  # 0.7.4 wants the graph buffers of exactly the metadata's shapes (kv_indices: at least)
            qo, kp, _, kl = self._bufs
            assert (qo.shape, kp.shape, kl.shape) == (m.qo_indptr.shape, m.kv_indptr.shape, m.kv_len_arr.shape)
        super().plan(m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr, **shape)

    def run(self, *args, query, kv_cache, return_lse_base_on_e=False, **kw):
        assert not args, "positional run() arguments, or q_nope / ckv_cache: deprecated in FlashInfer 0.7"
        assert isinstance(query, tuple) and isinstance(kv_cache, tuple)  # 0.7.4's split form: tuples only
        # As FlashInfer: the run's lse must be the one the plan declared.
        assert self._lse_mode == ("basee" if return_lse_base_on_e else "base2")
        return super().run(*query, *kv_cache, return_lse_base_on_e=return_lse_base_on_e, **kw)


def fake_flashinfer(keywords: bool = False) -> types.SimpleNamespace:
    """A stand-in for ``import flashinfer`` with the three wrappers the backend uses; keywords: with
    0.7.4's MLA API (MLAPlanMetadata) rather than 0.5.3's."""
    mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_MLAWrapper)
    if keywords:
        mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_MLAWrapperKeywords, MLAPlanMetadata=_MLAPlanMetadata)
    return types.SimpleNamespace(
        mla=mla,
        utils=types.SimpleNamespace(is_sm90a_supported=lambda device: True, get_device_sm_count=lambda device: 132),
        prefill=types.SimpleNamespace(
            BatchPrefillWithPagedKVCacheWrapper=_PagedPrefillWrapper,
            BatchPrefillWithRaggedKVCacheWrapper=_RaggedPrefillWrapper,
        ),
        __version__="emulated",
    )


# -- flash-attn ------------------------------------------------------------------


def _fa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, qv=None, block_table=None, inf_for_empty=True):
    _unit_stride(q, k, v, qv)
    _check_i32(cu_q=cu_q, cu_k=cu_k)
    t, h = q.shape[:2]
    o = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(h, t, dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(cu_q.numel() - 1):
        m, n = cq[r + 1] - cq[r], ck[r + 1] - ck[r]
        if block_table is not None:
            npg = -(-n // k.shape[1])
            kb, vb = _paged(k, block_table[r, :npg].tolist(), n), _paged(v, block_table[r, :npg].tolist(), n)
        else:
            kb, vb = k[ck[r] : ck[r + 1]], v[ck[r] : ck[r + 1]]
        assert m <= max_q and n <= max_k
        qvr = None if qv is None else qv[cq[r] : cq[r + 1]]
        ob, lb = attend(
            q[cq[r] : cq[r + 1]], kb, vb, _bottom_right(m, n, causal), scale, qv=qvr, kv=None if qv is None else vb
        )
        o[cq[r] : cq[r + 1]] = ob
        lse[:, cq[r] : cq[r + 1]] = torch.where(torch.isneginf(lb), float("inf") if inf_for_empty else lb, lb).T.float()
    return o.to(q.dtype), lse


def fake_flash_attn_interface() -> types.ModuleType:
    """FA3's ``flash_attn_interface``: with_kvcache (paged, qv) and varlen_func (qv), lse (H, T)."""
    mod = types.ModuleType("flash_attn_interface")

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        qv=None,
        *,
        cache_seqlens=None,
        page_table=None,
        cu_seqlens_q=None,
        max_seqlen_q=None,
        softmax_scale=None,
        causal=False,
        return_softmax_lse=False,
        **kw,
    ):
        assert k is None and v is None
        _unit_stride(q, k_cache, v_cache, qv)
        lens = cache_seqlens.tolist()
        cu_k = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
        o, lse = _fa_varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            cu_k,
            max_seqlen_q,
            max(lens, default=0),
            softmax_scale,
            causal,
            qv=qv,
            block_table=page_table,
            inf_for_empty=False,
        )
        return (o, lse, None, None) if return_softmax_lse else o

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        seqused_q=None,
        seqused_k=None,
        softmax_scale=None,
        causal=False,
        qv=None,
        return_attn_probs=False,
        **kw,
    ):
        o, lse = _fa_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
            qv=qv,
            inf_for_empty=False,
        )
        return (o, lse) if return_attn_probs else o

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


def fake_flash_attn() -> types.ModuleType:
    """FA2's ``flash_attn``: varlen_func with block_table (pages of 256k), lse (H, T), +inf when empty."""
    mod = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        return_attn_probs=False,
        block_table=None,
        **kw,
    ):
        assert q.shape[-1] == v.shape[-1] <= 256 and dropout_p == 0.0
        if block_table is not None:
            assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        o, lse = _fa_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
            block_table=block_table,
        )
        return (o, lse, None) if return_attn_probs else o

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod
