"""FlashInfer backend (``pip install flashinfer-python``, extra ``flashinfer``).

MLA:
  context pass   BatchMLAPagedAttentionWrapper, non-causal, kv_len = this
                 rank's local context length; q split into q_nope / q_pe
                 views and the one cache tensor (P, page, 1, D) into ckv =
                 cache[..., :Dv] / kpe = cache[..., Dv:] views (no copies).
  query pass     the same wrapper, causal, over the step's fresh K/V seen as
                 a cache of pages of one token (kv_indices = 0..T-1), where
                 that kernel keeps every key (_causal_mla_exact); the dense
                 query pass elsewhere (refused under capture limits: it
                 reads the plan's own indices). FlashInfer 0.5.3's kernel
                 bounds a tile of packed rows' keys by floor((start + tile)
                 / heads), one key short of the tile's last query where
                 heads does not divide start + tile; where that key opens a
                 tile of keys it is lost. The tile is 64 rows, or 128 where
                 the step averages over 64 rows per request. On
                 an H200 the output was wrong (rel err 0.94 - 1.0) at 256
                 and 1024 heads. docs/backends.md has the measurements.
                 Both MLA wrappers ask for fa3 (sm90a) or fa2, the kernels
                 this rule models, not FlashInfer's "auto".
  capacity       FlashInfer's MLA planner keeps 16384 work items (a tile of
                 64 or 128 packed rows each, plus key splits); 0.5.3 writes
                 past its buffers beyond them. A pass that might need more
                 (about 2M packed rows: 16K tokens at 128 heads) is refused
                 at plan time, on every rank alike (ValueError).
  API            0.5.3's flat positional plan (0.6.0, 0.6.9 and
                 0.6.18.post1 ran it too), or where the release has
                 flashinfer.mla.MLAPlanMetadata (0.7.0, 0.7.1, 0.7.2,
                 0.7.2.post1 and 0.7.4 ran) its keyword form with the lse
                 mode fixed at plan time: the flat form only warns
                 (deprecated) there.
GQA:
  context pass   BatchPrefillWithPagedKVCacheWrapper (NHD), non-causal.
  query pass     BatchPrefillWithRaggedKVCacheWrapper, causal.
Tree masks (plan.query_mask) take the reference dense query pass: the
problem is a few tokens per request, and it keeps one module per layout.

lse: the MLA run is asked for base e (``return_lse_base_on_e``, FlashInfer
>= 0.5.3); the prefill wrappers return log2 and are scaled by ln 2. Rows with
no context are masked to (0, -inf) after the kernel: on an H200 the fa3 MLA
kernel wrote o = 0 but lse = -34656 (its finite "-inf", -5e4 in log2) there,
harmless in a merge with a non-empty state but not the contract (and only
done when the step has such rows, or always in capture mode).

Every ``plan()`` of a wrapper happens in :meth:`FlashInferBackend.plan`, once
per step; ``context`` / ``query`` only run kernels and are graph-capturable.
A wrapper holds one plan at a time: running a layer with an older step's
plan raises ValueError. With :class:`CaptureLimits` given, the wrappers keep
their metadata in fixed buffers (one set per B for MLA, per (B, T) for GQA), so a graph
captured once replays correctly after later plans with the same B and T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from twostage_mla.backends._dense import dense_query
from twostage_mla.backends._paged import (
    LN2,
    empty_context_rows,
    empty_state,
    last_page_lens,
    mask_empty_rows,
    page_lists,
)
from twostage_mla.backends.base import AttentionBackend, AttentionSpec, CaptureLimits, State
from twostage_mla.layout import local_pages
from twostage_mla.plan import StepPlan

_DENSE_UNDER_LIMITS = (
    "the dense query pass that replaces it reads the plan's own indices, which a graph replayed after a later "
    "plan would not follow"
)


def _causal_mla_exact(heads: int, row_tile: int, key_tile: int = 16) -> bool:
    """Whether FlashInfer's causal MLA kernel keeps every key of a causal pass with no context (the
    query pass) at ``heads``, in tiles of ``row_tile`` packed rows (query x head).

    A tile ending at packed row m reads the key tiles up to m // heads: one key short of its last
    query's own where heads does not divide m, and that key is lost where m // heads is a multiple of
    the key tile (64 keys on sm90, 32 or 16 on sm80 GPUs; 16 covers them all). The pattern repeats
    every heads * key_tile row tiles.
    """
    ends = range(row_tile, row_tile * heads * key_tile + 1, row_tile)
    return all(m % heads == 0 or (m // heads) % key_tile for m in ends)


_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial states)
# FlashInfer's MLA planner (MLAPlan, scheduler.cuh) keeps at most this many work items: 0.5.3 writes past
# its buffers beyond (wrong results), later releases refuse the plan.
_MLA_MAX_WORKS = 16384


def _mla_row_tile(tokens: int, batch: int, heads: int) -> int:
    """Packed rows (query x head) per tile of FlashInfer's MLA kernel for a pass of tokens x heads over batch
    requests: its MLAPlan (scheduler.cuh) takes clusters of two 64-row CTAs where the batch averages over 64."""
    return 128 if tokens * heads // batch > 64 else 64


def _mla_work_bound(tokens: int, batch: int, heads: int, num_sm: int) -> int:
    """An upper bound of the work items FlashInfer's MLA planner makes for one pass, from the step's tokens,
    requests and heads alone: the same on every rank of GPUs alike (num_sm).

    MLAPlan cuts each request's packed rows (query x head) into tiles of 64 rows, or 128 where the
    batch averages over 64, and splits a tile's keys where they exceed sum(keys) / clusters: at most
    one tile per request more than tokens * heads / tile, and splits add fewer than one work per cluster.
    """
    tile = _mla_row_tile(tokens, batch, heads)
    return tokens * heads // tile + batch + num_sm // (tile // 64)


def _pages_on_rank0(plan: StepPlan) -> int:
    """Pages the context pass reads on rank 0, the most of any rank.

    The capture limit is checked against this rank-independent count, so a
    step over the limit is refused on every rank alike (no rank left alone in
    a collective).
    """
    n, i = plan.layout.world_size, plan.layout.interleave
    return sum(local_pages(c, n, i, 0, plan.page_size) for c in plan.context_lens.tolist())


def _flashinfer() -> Any:
    import flashinfer  # lazy: optional package, slow import, and CPU-only machines lack it

    return flashinfer


@dataclass
class _Wrappers:
    """The wrappers of one batch size (or of every step, without capture limits)."""

    ctx: Any
    qry: Any
    empty_rows: torch.Tensor | None = None  # (max_tokens, 1) bool, fixed buffer in capture mode
    generation: int = 0
    mla_metadata: Any = None  # flashinfer.mla.MLAPlanMetadata where the release has it (the keyword API)


def _plan_mla(wrapper: Any, metadata: Any, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
              kv_indices: torch.Tensor, kv_lens: torch.Tensor, heads: int, page_size: int, causal: bool,
              spec: AttentionSpec) -> None:
    """Plan one MLA wrapper in the form its FlashInfer release takes.

    0.5 takes flat positional metadata and the lse base at run time; later releases take a metadata
    object, keywords and the lse mode at plan time, and only warn (deprecated) on the flat form.
    """
    dv = spec.head_dim_v
    shape = dict(num_heads=heads, head_dim_ckv=dv, head_dim_kpe=spec.head_dim - dv, page_size=page_size,
                 causal=causal, sm_scale=spec.scale, q_data_type=spec.dtype, kv_data_type=spec.dtype)
    if metadata is None:
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, **shape)
    else:
        wrapper.plan(metadata=metadata.csr(qo_indptr, kv_indptr, kv_indices, kv_lens), query_layout="split",
                     kv_cache_layout="split", lse_mode="basee", **shape)


def _run_mla(wrapper: Any, metadata: Any, q: torch.Tensor, kv: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor) -> None:
    """Run one planned MLA wrapper: q (T, H, D), kv (P, page, D) -> o (T, H, Dv), lse (T, H) natural log, in place."""
    dv = o.shape[-1]
    query, cache = (q[..., :dv], q[..., dv:]), (kv[..., :dv], kv[..., dv:])
    if metadata is None:
        wrapper.run(*query, *cache, out=o, lse=lse, return_lse=True, return_lse_base_on_e=True)
    else:
        wrapper.run(query=query, kv_cache=cache, out=o, lse=lse, return_lse=True, return_lse_base_on_e=True)


@dataclass(frozen=True)
class FlashInferState:
    """What one step's plan left for the per-layer calls (StepPlan.backend_state)."""

    wrappers: _Wrappers | None  # None: the step has no tokens
    generation: int  # must equal wrappers.generation when a layer runs
    empty_rows: torch.Tensor | None  # (T, 1) bool rows to set to (0, -inf), or None
    context: bool = True  # False: no rank-local context in this step, no context kernel planned (eager only)
    query_kernel: bool = True  # False: FlashInfer's causal MLA kernel is not exact at this step (dense query pass)


class FlashInferBackend(AttentionBackend):
    """Two passes through FlashInfer's wrappers; MLA at 512 + 64, GQA at head dim 64/128/256.

    spec: the layer's shapes; limits: optional maxima for graph replay across
    steps (see :class:`CaptureLimits`).
    """

    name = "flashinfer"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    kv_formats = ("mla", "gqa")
    packages = ("flashinfer",)
    min_version = ("flashinfer-python", "0.5.3")  # the release this backend ran with on H200s
    min_compute_capability = (8, 0)
    replays_across_steps = True

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        if spec.kv_format == "mla" and (spec.head_dim_v, spec.head_dim - spec.head_dim_v) != (512, 64):
            return [f"MLA kernels are built for kv_lora_rank 512 + rope 64, got {spec.head_dim_v} + "
                    f"{spec.head_dim - spec.head_dim_v}"]
        if spec.kv_format == "gqa" and (spec.head_dim != spec.head_dim_v or spec.head_dim not in (64, 128, 256)):
            return [f"GQA needs head_dim == head_dim_v in (64, 128, 256), got {spec.head_dim}/{spec.head_dim_v}"]
        return []

    def __init__(self, spec: AttentionSpec, limits: CaptureLimits | None = None) -> None:
        super().__init__(spec, limits)
        self._mla = spec.kv_format == "mla"
        self._ctx_heads = spec.num_heads * spec.world_size
        # Where FlashInfer's causal MLA kernel is exact, by its row tile (all True for GQA: another kernel).
        self._exact = {t: not self._mla or _causal_mla_exact(spec.num_heads, t) for t in (64, 128)}
        self._workspace: torch.Tensor | None = None
        self._num_sm = 0  # the device's SM count, read with the first wrappers
        # Capture mode: one set per batch size, for GQA per (B, T): FlashInfer's prefill wrappers
        # in CUDA-graph mode fix their row count at the first plan (MLA's do not).
        self._by_batch: dict[int | tuple[int, int], _Wrappers] = {}
        self._shared: _Wrappers | None = None

    def use_query_pass(self, on: bool) -> None:
        if on and not any(self._exact.values()) and self.limits.given:
            raise ValueError(
                f"expected the fused query pass (fuse_query None or True; it needs Triton) with capture limits at "
                f"{self.spec.num_heads} heads, got the backend's own: FlashInfer's causal MLA kernel loses keys at "
                f"{self.spec.num_heads} heads, and {_DENSE_UNDER_LIMITS}"
            )
        super().use_query_pass(on)

    # -- wrappers -------------------------------------------------------------

    def _ws(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.spec.device)
        return self._workspace

    def _make(self, b: int | None) -> _Wrappers:
        """Wrappers for batch size b with fixed buffers, or plain ones (b None)."""
        fi, ws, dev = _flashinfer(), self._ws(), self.spec.device
        i32 = dict(dtype=torch.int32, device=dev)
        # The MLA kernels _causal_mla_exact models, chosen as FlashInfer 0.5.3's "auto" does: later
        # releases' "auto" may pick others (trtllm-gen, cute-dsl on sm100) with other tiling.
        mla_kernel = "fa3" if self._mla and fi.utils.is_sm90a_supported(torch.device(dev)) else "fa2"
        self._num_sm = fi.utils.get_device_sm_count(torch.device(dev))
        metadata = getattr(fi.mla, "MLAPlanMetadata", None)
        if b is None:
            if self._mla:
                return _Wrappers(fi.mla.BatchMLAPagedAttentionWrapper(ws, backend=mla_kernel),
                                 fi.mla.BatchMLAPagedAttentionWrapper(ws, backend=mla_kernel),
                                 mla_metadata=metadata)
            return _Wrappers(
                fi.prefill.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
                fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD"),
            )
        lim = self.limits
        rows = torch.zeros(lim.max_tokens, 1, dtype=torch.bool, device=dev)
        if self._mla:
            def mla(n_idx: int) -> Any:
                return fi.mla.BatchMLAPagedAttentionWrapper(
                    ws, use_cuda_graph=True, qo_indptr=torch.zeros(b + 1, **i32),
                    kv_indptr=torch.zeros(b + 1, **i32), kv_indices=torch.zeros(n_idx, **i32),
                    kv_len_arr=torch.zeros(b, **i32), backend=mla_kernel,
                )

            return _Wrappers(mla(lim.max_pages), mla(lim.max_tokens), rows, mla_metadata=metadata)
        ctx = fi.prefill.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(b + 1, **i32),
            paged_kv_indptr_buf=torch.zeros(b + 1, **i32), paged_kv_indices_buf=torch.zeros(lim.max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(b, **i32),
        )
        qry = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(b + 1, **i32),
            kv_indptr_buf=torch.zeros(b + 1, **i32),
        )
        return _Wrappers(ctx, qry, rows)

    def _wrappers_for(self, plan: StepPlan) -> _Wrappers:
        if not self.limits.given:
            if self._shared is None:
                self._shared = self._make(None)
            return self._shared
        key = plan.batch_size if self._mla else (plan.batch_size, plan.num_tokens)
        if key not in self._by_batch:
            self._by_batch[key] = self._make(plan.batch_size)
        return self._by_batch[key]

    # -- per step -------------------------------------------------------------

    def plan(self, plan: StepPlan) -> FlashInferState:
        """Plan both passes for this step (host sync; not capturable)."""
        if self.limits.given:  # an empty step too: the layer's fixed buffers have the same sizes
            pages = _pages_on_rank0(plan)
            self.limits.check(max_batch_size=plan.batch_size, max_tokens=plan.num_tokens, max_pages=pages)
        if plan.num_tokens == 0:
            return FlashInferState(None, 0, None)
        s = self.spec
        dt, scale = s.dtype, s.scale
        qsl = plan.query_start_loc
        page_indptr, page_indices = page_lists(plan.block_table, plan.local_context_lens, plan.page_size)
        w = self._wrappers_for(plan)
        # A step with no context on this rank (a first prefill chunk; ranks past a short context)
        # returns the empty state without a kernel, as the other backends do. A captured graph
        # must serve later steps, so under capture limits the kernel runs (and its rows are masked).
        context = self.limits.given or plan.max_local_context_len > 0
        # Tree masks take the base class's dense query pass: no query kernel to plan then.
        plan_query = plan.query_mask is None and self.query_pass
        tile = _mla_row_tile(plan.num_tokens, plan.batch_size, s.num_heads)
        query_kernel = self._exact[tile]
        if plan_query and not query_kernel and self.limits.given:  # e.g. 128 heads, half the requests empty
            raise ValueError(
                f"expected the fused query pass (fuse_query None or True) with capture limits at this step, got "
                f"the backend's own: at {plan.num_tokens} tokens x {s.num_heads} heads over {plan.batch_size} "
                f"requests FlashInfer's causal MLA kernel takes tiles of {tile} rows, which lose keys at "
                f"{s.num_heads} heads, and {_DENSE_UNDER_LIMITS}"
            )
        plan_query = plan_query and query_kernel
        # The wrappers' earlier plans end here, also where FlashInfer refuses this one halfway (0.7.4 refuses
        # some plans): a state of an earlier step must not run on a half-replanned wrapper.
        w.generation += 1
        if self._mla:
            # Checked where any rank has context, so every rank refuses alike.
            if self.limits.given or plan.max_context_len > 0:
                self._check_works("context", plan, self._ctx_heads)
            if plan_query:
                self._check_works("query", plan, s.num_heads)
            if context:
                _plan_mla(w.ctx, w.mla_metadata, qsl, page_indptr, page_indices, plan.local_context_lens,
                          self._ctx_heads, plan.page_size, False, s)
            if plan_query:
                # The fresh K/V as a cache of one-token pages: page i is token i.
                tok = torch.arange(plan.num_tokens, dtype=torch.int32, device=qsl.device)
                _plan_mla(w.qry, w.mla_metadata, qsl, qsl, tok, plan.q_lens, s.num_heads, 1, True, s)
        else:
            if context:
                w.ctx.plan(qsl, page_indptr, page_indices, last_page_lens(plan), self._ctx_heads, s.num_kv_heads,
                           s.head_dim, plan.page_size, head_dim_vo=s.head_dim_v, causal=False, sm_scale=scale,
                           q_data_type=dt, kv_data_type=dt)
            if plan_query:
                w.qry.plan(qsl, qsl, s.num_heads, s.num_kv_heads, s.head_dim, head_dim_vo=s.head_dim_v,
                           causal=True, sm_scale=scale, q_data_type=dt, kv_data_type=dt)
        empty = empty_context_rows(plan)
        if w.empty_rows is not None:  # capture mode: always mask, through the fixed buffer
            buf = w.empty_rows[: plan.num_tokens]
            buf.copy_(empty if empty is not None else torch.zeros_like(buf))
            empty = buf
        return FlashInferState(w, w.generation, empty, context, query_kernel)

    def prefers_expanded_context(self, plan: StepPlan) -> bool:
        # Measured on an H100 (docs/performance.md, "The expanded context pass"): from 16384 packed
        # rows in the step (tokens x gathered heads, e.g. B = 32, Q = 4 at 128 heads) and 256 a
        # request, at 64 heads or more, the MLA kernel is compute-bound, the expanded pass takes what
        # the non-causal one does and the split's query merge (a pass over T x H x Dv outputs) is
        # saved: 15 % at C = 1K, 0.5 % at 32K. At 8192 rows (B = 32, Q = 2; B = 8, Q = 8) the split's
        # context pass was up to 2x faster than the expanded one; at 16 heads far faster (the expanded
        # pass reads the cache once per token). With one token per request it reads the cache once too,
        # and saves the query merge: 3 - 14 us a layer at B = 32, contexts drawn at random
        # (docs/performance.md, "Unequal contexts and steps of one token").
        heads, rows = self._ctx_heads, self._ctx_heads * plan.num_tokens
        one_each = plan.max_q_len == 1
        return self._mla and (one_each or (heads >= 64 and rows >= 16384 and rows >= 256 * plan.batch_size))

    def _check_works(self, name: str, plan: StepPlan, heads: int) -> None:
        works = _mla_work_bound(plan.num_tokens, plan.batch_size, heads, self._num_sm)
        if works > _MLA_MAX_WORKS:
            n = plan.layout.world_size
            seen = f"{heads} heads ({heads // n} x {n} ranks)" if name == "context" and n > 1 else f"{heads} heads"
            raise ValueError(
                f"expected a step within FlashInfer's MLA planner ({_MLA_MAX_WORKS} work items), got up to {works} "
                f"for the {name} pass at {plan.num_tokens} tokens x {seen} in {plan.batch_size} request(s): "
                f"FlashInfer 0.5.3 writes past its buffers there (NaN or a fault, no error) and later releases "
                f"refuse; plan fewer tokens per step, or take another backend for such steps"
            )

    def invalidate_plans(self) -> None:
        for w in [self._shared, *self._by_batch.values()]:
            if w is not None:
                w.generation += 1

    def check_plan(self, plan: StepPlan) -> None:
        self._state(plan)

    def _state(self, plan: StepPlan) -> FlashInferState:
        st = self._plan_state(plan, FlashInferState)
        if st.wrappers is not None and st.generation != st.wrappers.generation:
            raise ValueError(
                "expected the latest plan of this layer: FlashInfer wrappers hold one step's plan at a time, "
                "and plan() has been called again since this plan was made"
            )
        return st

    # -- per layer ------------------------------------------------------------

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """Non-causal paged pass; q (T, N*H, D) -> o (T, N*H, Dv) q.dtype, lse (T, N*H) float32.

        Graph-capturable (no host sync).
        """
        st, dv = self._state(plan), self.spec.head_dim_v
        t, h = q.shape[0], q.shape[1]
        if st.wrappers is None or not st.context:
            return empty_state(t, h, dv, q)
        o = q.new_empty((t, h, dv))
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
        if self._mla:
            kv = k_cache[:, :, 0]  # (P, page, D): the one latent head
            _run_mla(st.wrappers.ctx, st.wrappers.mla_metadata, q, kv, o, lse)
            return mask_empty_rows(o, lse, st.empty_rows)
        st.wrappers.ctx.run(q, (k_cache, v_cache), out=o, lse=lse, return_lse=True)
        lse.mul_(LN2)
        return mask_empty_rows(o, lse, st.empty_rows)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Causal pass over the fresh K/V; q (T, H, D) -> o (T, H, Dv), lse (T, H) float32.

        Graph-capturable (no host sync).
        """
        st, dv = self._state(plan), self.spec.head_dim_v
        if not st.query_kernel:
            return dense_query(q, k, v, plan, self.spec.scale)
        t, h = q.shape[0], q.shape[1]
        o = q.new_empty((t, h, dv))
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
        if self._mla:
            _run_mla(st.wrappers.qry, st.wrappers.mla_metadata, q, k, o, lse)  # k (T, 1, D): pages of one token
            return o, lse
        st.wrappers.qry.run(q, k, v, out=o, lse=lse, return_lse=True)
        return o, lse.mul_(LN2)
