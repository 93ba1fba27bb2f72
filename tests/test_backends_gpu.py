"""Every GPU backend present, through the whole layer, against the float64 oracle (marker ``gpu``).

One rank (N = 1) on one GPU: bf16 and fp16, MLA 576/512 (16 heads) and GQA
(8 query heads over 2 KV heads, head dim 128); in bf16 also MLA with 1 - 1024
heads and GQA at head dims 64 and 256 and other groupings, chunked prefills of
hundreds of tokens, and float32 where a backend declares it; page sizes 1..256,
contexts that are empty, shorter than a page, a page, longer; causal chains
and tree masks. CUDA graphs: the per-layer call captured once and replayed
many times gives the eager result; with capture limits (flashinfer) a graph
captured for one step replays correctly after the next step's plan.
The two-GPU test (marker ``multigpu``) runs the layer with N = 2 over NCCL.
Skipped without CUDA.
"""

from __future__ import annotations

import os
import random
import re
import socket
import tempfile

import pytest
import torch

from tests._views import strided_last, strided_pages
from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, synthetic
from twostage_mla.backends import AttentionSpec, backend_names, refusals, select_backend
from twostage_mla.check import verdict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = torch.device("cuda", 0)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}  # max |out - oracle| / max |oracle|
LSE_TOL = 2e-3  # inputs are exact in the dtype, lse is float32: only accumulation rounding
MLA = dict(kv_lora_rank=512, rope_dim=64)


def _config(fmt: str, heads: int, page_size: int, kv_heads: int = 2, head_dim: int = 128) -> AttentionConfig:
    """MLA 576/512 (kv_heads and head_dim unused), or GQA of heads over kv_heads at head_dim."""
    if fmt == "mla":
        return AttentionConfig.mla(num_heads=heads, page_size=page_size, scale=(128 + 64) ** -0.5, **MLA)
    return AttentionConfig(
        num_heads=heads,
        head_dim=head_dim,
        head_dim_v=head_dim,
        page_size=page_size,
        scale=head_dim**-0.5,
        num_kv_heads=kv_heads,
        kv_format="gqa",
    )


def _spec(cfg: AttentionConfig, dtype: torch.dtype) -> AttentionSpec:
    return AttentionSpec(
        cfg.kv_format,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.head_dim_v,
        cfg.page_size,
        1,
        cfg.scale,
        dtype,
        DEV,
    )


def _serving(cfg: AttentionConfig, dtype: torch.dtype) -> list[str]:
    """Backends that can serve this layer on this GPU (the reference included)."""
    return [n for n, why in refusals(_spec(cfg, dtype)).items() if not why]


def _served_config(name: str, fmt: str) -> AttentionConfig:
    """The layer most tests use (MLA 16 heads or GQA 8 over 2, page 64, bf16); skip where ``name`` cannot serve it."""
    cfg = _config(fmt, 16 if fmt == "mla" else 8, 64)
    if name not in _serving(cfg, torch.bfloat16):
        pytest.skip(f"{name} does not serve {fmt} here")
    return cfg


def _run(name, cfg, dtype, ctx, ql, *, tree=False, seed=0, limits=None, fuse=None, fill=None, context_pass="split"):
    fmt_mla = cfg.kv_format == "mla"
    step = synthetic.make_step(
        ctx,
        ql,
        heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim_v,
        kv_heads=cfg.num_kv_heads,
        mla=fmt_mla,
        tree=tree,
        dtype=dtype,
        seed=seed,
    )
    x = synthetic.rank_inputs(
        step, DCPLayout(), cfg.page_size, mla=fmt_mla, dtype=dtype, device=DEV, seed=seed, fill=fill
    )
    attn = TwoStageAttention(cfg, DCPLayout(), backend=name, dtype=dtype, device=DEV, fuse_query=fuse,
                             context_pass=context_pass, **(limits or {}))
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    return step, x, attn, plan


def _check(step, cfg, dtype, out, lse, what):
    ref_o, ref_lse = synthetic.oracle(step, cfg.scale)
    assert out.dtype == dtype and lse.dtype == torch.float32, what
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), what
    rel = ((out.double().cpu() - ref_o).abs().max() / ref_o.abs().max()).item()
    lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
    assert rel < TOL[dtype], f"{what}: rel err {rel:.2e}"
    assert lse_err < LSE_TOL, f"{what}: lse err {lse_err:.2e}"
    return rel, lse_err


def _cases() -> list[tuple]:
    rng = random.Random(0)
    out = []
    for fmt in ("mla", "gqa"):
        heads = 16 if fmt == "mla" else 8
        for dtype in (torch.bfloat16, torch.float16):
            for page, tree in ((1, False), (16, True), (64, False), (256, False)):
                ctx = [
                    0,
                    1,
                    page - 1 if page > 1 else 2,
                    page,
                    page + 1,
                    rng.randrange(300, 900),
                    rng.randrange(2000, 3000),
                ]
                ql = [rng.randint(1, 8) for _ in ctx]
                ql[rng.randrange(len(ql))] = 16
                out.append((fmt, heads, dtype, page, tree, ctx, ql))
            # Plain decoding, one token per request: the kernels' one-token paths.
            out.append((fmt, heads, dtype, 64, False, [0, 5, 64, 700, 2500], [1] * 5))
    return out


CASES = _cases()


@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize(
    "fmt,heads,dtype,page,tree,ctx,ql",
    CASES,
    ids=[f"{c[0]}-{str(c[2])[6:]}-p{c[3]}{'-tree' if c[4] else ''}" for c in CASES],
)
def test_backend_matches_oracle(name, fmt, heads, dtype, page, tree, ctx, ql, fuse):
    cfg = _config(fmt, heads, page)
    if name not in _serving(cfg, dtype):
        pytest.skip(f"{name}: {'; '.join(refusals(_spec(cfg, dtype))[name])}")
    step, x, attn, plan = _run(name, cfg, dtype, ctx, ql, tree=tree, seed=page, fuse=fuse)
    assert (attn.query_merge is not None) == fuse
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    rel, lse_err = _check(step, cfg, dtype, out, lse, name)
    print(f"{name} {fmt} {dtype} page {page} tree {tree} fuse {fuse}: rel {rel:.2e} lse {lse_err:.2e}")


@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_nan_in_unwritten_cache_slots(name, fmt):
    """An engine's torch.empty cache may hold NaN past a request's length: it must never leak in."""
    cfg = _served_config(name, fmt)
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 5, 70, 700], [3, 2, 8, 1], seed=3, fill=float("nan"))
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    _check(step, cfg, torch.bfloat16, out, lse, f"{name} with NaN in unwritten slots")


# Heads on a rank are the model's over tensor parallelism (DeepSeek-V3 128 / TP, Kimi K2 64 / TP, 40-head
# MLA models / TP: 10, 20), and a rank's context pass sees N times them under DCP (16 x 8 = 128 ... 128 x 8 =
# 1024): at N = 1 the layer runs its kernels on exactly those head counts. GQA: (heads, kv_heads, head_dim).
HEAD_COUNTS = [("mla", h, 1, 576) for h in (1, 2, 4, 8, 10, 20, 32, 64, 128, 256, 1024)] + [
    ("gqa", h, hk, d) for h, hk, d in ((1, 1, 64), (4, 4, 128), (10, 2, 128), (32, 8, 128), (16, 1, 256), (64, 8, 64))
]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])  # a chain: the backend's own query pass
@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("name", [n for n in backend_names() if n != "reference"])
@pytest.mark.parametrize("fmt,heads,kv_heads,dim", HEAD_COUNTS, ids=[f"{f}-{h}x{k}-d{d}" for f, h, k, d in HEAD_COUNTS])
def test_head_counts(name, fuse, tree, fmt, heads, kv_heads, dim):
    cfg = _config(fmt, heads, 64, kv_heads, dim)
    if name not in _serving(cfg, torch.bfloat16):
        pytest.skip(f"{name}: {'; '.join(refusals(_spec(cfg, torch.bfloat16))[name])}")
    ctx, ql = ([0, 63, 700, 2100], [4, 1, 16, 3]) if heads <= 128 else ([0, 100, 900], [4, 1, 8])
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, ctx, ql, tree=tree, seed=heads, fuse=fuse)
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    rel, lse_err = _check(step, cfg, torch.bfloat16, out, lse, f"{name} {fmt} {heads}x{kv_heads} d{dim}")
    print(f"{name} {fmt} {heads}x{kv_heads} d{dim} fuse {fuse} tree {tree}: rel {rel:.2e} lse {lse_err:.2e}")


@pytest.mark.parametrize("heads", [40, 96, 128, 256], ids=lambda h: f"mla-{h}")
def test_head_counts_flashinfer_mla_half_empty_batch(heads):
    """Half the requests empty, as an engine pads a batch: FlashInfer's causal MLA kernel then takes 64-row
    tiles, and past 64 heads its first tile reads no key (docs/backends.md). The backend's own query pass
    stays exact; forced onto the kernel it is wrong past 64 heads, or refused there by FlashInfer releases that
    check the same bound (else the rule, not the kernel, is off)."""
    cfg = _config("mla", heads, 64)
    if "flashinfer" not in _serving(cfg, torch.bfloat16):
        pytest.skip("flashinfer does not serve MLA here")
    step, x, attn, plan = _run("flashinfer", cfg, torch.bfloat16, [50, 700, 0, 9], [1, 0, 1, 0], seed=heads,
                               fuse=False)  # fmt: skip
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    _check(step, cfg, torch.bfloat16, out, lse, f"flashinfer mla {heads} heads, half the requests empty")
    attn.backend._exact = {64: True, 128: True}  # FlashInfer's kernel at every step, then a plan that takes it
    try:
        forced = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    except Exception as e:  # FlashInfer 0.7.4 refuses the plan where its kernel would lose a key (0.5.3 runs it)
        print(f"FlashInfer's causal MLA kernel alone at {heads} heads, half the requests empty: refused ({e})")
        assert heads > 64 and "causal tile boundary is unsupported" in str(e), f"{heads} heads: {e}"
        return
    out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, forced)
    _, rel, _ = verdict(out, synthetic.oracle(step, cfg.scale)[0], torch.bfloat16)
    print(f"FlashInfer's causal MLA kernel alone at {heads} heads, half the requests empty: rel err {rel:.2e}")
    assert (rel > 0.1) == (heads > 64), f"{heads} heads: rel err {rel:.2e}"


@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_chunked_prefill(name, fmt, fuse):
    """Chunks of hundreds of new tokens (a first chunk, one over context) beside decode tokens in one step:
    the query passes' long causal loops, which the grid's q_len <= 16 never reaches."""
    cfg = _served_config(name, fmt)
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 700, 1500, 64], [200, 1, 512, 37], seed=9, fuse=fuse)
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    _check(step, cfg, torch.bfloat16, out, lse, f"{name} {fmt} chunked prefill")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_float32(name, fmt, tree):
    """Where a backend declares float32 (torch_efficient, the reference), it is float32-exact on the GPU.
    The fused kernel serves bf16 and fp16 only: by default the layer merges without it, and asked for it,
    it says so."""
    cfg = _config(fmt, 16 if fmt == "mla" else 8, 64)
    if name not in _serving(cfg, torch.float32):
        pytest.skip(f"{name}: {'; '.join(refusals(_spec(cfg, torch.float32))[name])}")
    step, x, attn, plan = _run(name, cfg, torch.float32, [0, 63, 700, 2100], [4, 1, 16, 3], seed=5, tree=tree)
    assert attn.query_merge is None
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    _check(step, cfg, torch.float32, out, lse, f"{name} {fmt} float32")
    with pytest.raises(ValueError, match="the fused kernel needs CUDA, Triton and bf16 or fp16"):
        TwoStageAttention(cfg, DCPLayout(), backend=name, dtype=torch.float32, device=DEV, fuse_query=True)


@pytest.mark.parametrize("name", [n for n in backend_names() if n != "reference"])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_empty_context_rows_are_the_empty_state(name, fmt):
    """The context pass itself returns (0, -inf) for a request with no context, whatever the kernel writes."""
    cfg = _served_config(name, fmt)
    _, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 70, 0], [3, 2, 1])
    v_cache = x.k_cache[..., : cfg.head_dim_v] if fmt == "mla" else x.v_cache
    o, lse = attn.backend.context(x.q, x.k_cache, v_cache, plan)
    empty = torch.tensor([0, 1, 2, 5])  # tokens of requests 0 and 2
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[3:5]).all()


@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_a_step_with_no_context(name, fmt, fuse):
    """A first prefill chunk: no request has context on this rank (eager: FlashInfer runs no context kernel)."""
    cfg = _served_config(name, fmt)
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 0, 0], [3, 1, 5], seed=4, fuse=fuse)
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    _check(step, cfg, torch.bfloat16, out, lse, name)


def _graph(fn):
    """Capture fn() in a CUDA graph (after warm-up on a side stream); returns (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_cuda_graph_replay_matches_eager(name, fmt, fuse, tree):
    # Unfused tree steps take the dense query pass (every backend's fallback), the reference backend
    # takes it always: both must capture, i.e. make no host sync (a boolean index would).
    cfg = _served_config(name, fmt)
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 63, 700, 2000], [4, 1, 8, 3], seed=2, tree=tree,
                               fuse=fuse)  # fmt: skip
    eager, eager_lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    g, (out, lse) = _graph(lambda: attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True))
    for _ in range(50):
        out.fill_(float("nan"))  # poison: every replay must write every element
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    _check(step, cfg, torch.bfloat16, out, lse, name)


EXPAND_CASES = [(fmt, dtype) for fmt in ("mla", "gqa") for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt,dtype", EXPAND_CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in EXPAND_CASES])
def test_expanded_context_pass_matches_oracle(name, fmt, dtype):
    # Unwritten slots hold NaN: the expanded pass reads the new tokens' slots, which the shard holds.
    cfg = _config(fmt, 16 if fmt == "mla" else 8, 64)
    if name not in _serving(cfg, dtype):
        pytest.skip(f"{name}: {'; '.join(refusals(_spec(cfg, dtype))[name])}")
    ctx, ql = [0, 1, 63, 64, 700, 2500], [5, 1, 16, 2, 8, 3]
    step, x, attn, plan = _run(name, cfg, dtype, ctx, ql, seed=11, fill=float("nan"), context_pass="expand")
    assert plan.context_plan is not None
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    rel, lse_err = _check(step, cfg, dtype, out, lse, f"{name} expanded")
    print(f"{name} {fmt} {dtype} expanded: rel {rel:.2e} lse {lse_err:.2e}")


@pytest.mark.parametrize("q_len,expands", [(4, True), (8, True), (2, False), (1, True)])
def test_flashinfer_auto_at_128_heads_matches_oracle_eager_and_in_a_graph(q_len, expands):
    cfg = _config("mla", 128, 64)
    if "flashinfer" not in _serving(cfg, torch.bfloat16):
        pytest.skip("flashinfer does not serve MLA here")
    ctx = [0, 63, 700, 2100, 5000, 64, 1, 300] * 4  # 32 requests: 16384 packed rows from q_len 4
    step, x, attn, plan = _run("flashinfer", cfg, torch.bfloat16, ctx, [q_len] * len(ctx), seed=q_len,
                               context_pass="auto")  # fmt: skip
    assert (plan.context_plan is not None) == expands
    plan.write_new_tokens(x.k_cache, x.k)  # the contract of 'auto' (the shard holds them already)
    eager, eager_lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    g, (out, lse) = _graph(lambda: attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True))
    for _ in range(20):
        out.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    _check(step, cfg, torch.bfloat16, out, lse, f"flashinfer auto q_len {q_len}")


@pytest.mark.parametrize("max_tokens", [16, 32])
@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_flashinfer_graph_replays_after_a_new_plan(fmt, fuse, max_tokens):
    """Capture limits: one graph, captured for step A, replayed after plan(B) gives B's answer.

    Same B and T, other q_lens and contexts: every per-step index the graph reads must be refilled.
    max_tokens 32 (requests may have more than 16 tokens): the fused kernel's long variant. With the
    fused kernel and max_tokens 16, a tree step too: the graph was captured at a chain step.
    """
    cfg = _served_config("flashinfer", fmt)
    dt, mla = torch.bfloat16, fmt == "mla"
    steps = [
        synthetic.make_step(
            c,
            ql,
            heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            head_dim_v=cfg.head_dim_v,
            kv_heads=cfg.num_kv_heads,
            mla=mla,
            dtype=dt,
            tree=tree,
            seed=s,
        )
        for s, c, ql, tree in (
            (0, [100, 0, 900, 3000], [4, 2, 1, 5], False),
            (1, [2500, 64, 0, 700], [1, 6, 3, 2], False),
            (2, [300, 5000, 17, 0], [3, 4, 2, 3], True),
            (3, [0, 0, 0, 0], [2, 5, 1, 4], False),  # a first prefill chunk: the kernel runs over no context
        )
        if not tree or (fuse and max_tokens <= 16)
    ]
    xs = [synthetic.rank_inputs(s, DCPLayout(), 64, mla=mla, dtype=dt, device=DEV) for s in steps]
    pages = max(x.k_cache.shape[0] for x in xs)
    width = max(x.block_table.shape[1] for x in xs)
    attn = TwoStageAttention(
        cfg, DCPLayout(), backend="flashinfer", dtype=dt, device=DEV, max_batch_size=4, max_tokens=max_tokens,
        max_pages=pages, fuse_query=fuse,
    )  # fmt: skip
    assert (attn.query_merge is not None) == fuse

    def static(t, shape):  # a fixed buffer the graph reads, refilled per step
        return torch.zeros(shape, dtype=t.dtype, device=DEV)

    sq, sk = static(xs[0].q, xs[0].q.shape), static(xs[0].k, xs[0].k.shape)
    skc = static(xs[0].k_cache, (pages, *xs[0].k_cache.shape[1:]))
    sv = None if mla else static(xs[0].v, xs[0].v.shape)
    svc = None if mla else static(xs[0].v_cache, (pages, *xs[0].v_cache.shape[1:]))

    def load(x):
        sq.copy_(x.q)
        sk.copy_(x.k)
        skc[: x.k_cache.shape[0]].copy_(x.k_cache)
        if not mla:
            sv.copy_(x.v)
            svc[: x.v_cache.shape[0]].copy_(x.v_cache)
        bt = torch.zeros(4, width, dtype=torch.int32, device=DEV)
        bt[:, : x.block_table.shape[1]] = x.block_table
        return attn.plan(x.query_start_loc, x.seq_lens, bt, parents=x.parents)

    plan = load(xs[0])
    g, out = _graph(lambda: attn(sq, sk, sv, skc, svc, plan))
    for i, (s, x) in enumerate(zip(steps, xs)):
        p = load(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attn(sq, sk, sv, skc, svc, p)), f"step {i}"
        ref_o, _ = synthetic.oracle(s, cfg.scale)
        assert ((out.double().cpu() - ref_o).abs().max() / ref_o.abs().max()).item() < TOL[dt]


@pytest.mark.parametrize("name", [n for n in backend_names() if n != "reference"])
def test_layer_checks_on_cuda(name):
    """The layer's own checks on CUDA tensors: a page past the cache, a stale plan, a step of no tokens."""
    cfg = _config("mla", 16, 64)
    if name not in _serving(cfg, torch.bfloat16):
        pytest.skip(f"{name} does not serve MLA here")
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [100, 700], [4, 2], seed=5)
    with pytest.raises(ValueError, match=r"block_table page ids < k_cache.shape\[0\] = 1"):
        attn(x.q, x.k, None, x.k_cache[:1], None, plan)
    with pytest.raises(ValueError, match=r"block_table page ids < num_pages = 1"):
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table, num_pages=1)
    context = x.seq_lens - torch.tensor([4, 2], dtype=torch.int32, device=DEV)
    none = attn.plan(torch.zeros(3, dtype=torch.int32, device=DEV), context, x.block_table)
    o, lse = attn(x.q[:0], x.k[:0], None, x.k_cache, None, none, return_lse=True)
    assert o.shape == (0, 16, 512) and lse.shape == (0, 16)
    if name == "flashinfer":  # under capture limits with the fused kernel: only the latest plan
        limited = TwoStageAttention(
            cfg, DCPLayout(), backend=name, dtype=torch.bfloat16, device=DEV, max_batch_size=4, max_tokens=16,
            max_pages=x.k_cache.shape[0],
        )  # fmt: skip
        old = limited.plan(x.query_start_loc, x.seq_lens, x.block_table)
        latest = limited.plan(x.query_start_loc, x.seq_lens, x.block_table)
        with pytest.raises(ValueError, match="latest plan"):
            limited(x.q, x.k, None, x.k_cache, None, old)
        out, lse = limited(x.q, x.k, None, x.k_cache, None, latest, return_lse=True)
        _check(step, cfg, torch.bfloat16, out, lse, f"{name} under capture limits")


@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_flashinfer_steps_of_one_batch_and_other_token_counts(fmt, fuse):
    """Capture limits: decode steps (T = B) and verification steps (T > B) of the same B, in turn.

    FlashInfer's prefill wrappers in graph mode keep the row count of their first plan, so the layer
    holds GQA wrappers per (B, T). Each step runs eagerly against the oracle, and a graph captured at
    the first step of each T replays the later steps of that T.
    """
    cfg = _served_config("flashinfer", fmt)
    dt, mla = torch.bfloat16, fmt == "mla"
    qls = ([1, 1, 1, 1], [4, 2, 1, 5], [1, 1, 1, 1], [3, 3, 3, 3], [2, 6, 1, 3])
    steps = [
        synthetic.make_step(
            [700 + 300 * s, 64, 0, 1500][: len(ql)], ql, heads=cfg.num_heads, head_dim=cfg.head_dim,
            head_dim_v=cfg.head_dim_v, kv_heads=cfg.num_kv_heads, mla=mla, dtype=dt, seed=s,
        )
        for s, ql in enumerate(qls)
    ]  # fmt: skip
    xs = [synthetic.rank_inputs(s, DCPLayout(), 64, mla=mla, dtype=dt, device=DEV) for s in steps]
    pages, width = max(x.k_cache.shape[0] for x in xs), max(x.block_table.shape[1] for x in xs)
    attn = TwoStageAttention(
        cfg, DCPLayout(), backend="flashinfer", dtype=dt, device=DEV, max_batch_size=4, max_tokens=16,
        max_pages=pages, fuse_query=fuse,
    )  # fmt: skip
    skc = torch.zeros(pages, *xs[0].k_cache.shape[1:], dtype=dt, device=DEV)
    svc = None if mla else torch.zeros(pages, *xs[0].v_cache.shape[1:], dtype=dt, device=DEV)
    graphs = {}  # T -> (graph, its static q, k, v, output)
    for i, (s, x) in enumerate(zip(steps, xs)):
        skc[: x.k_cache.shape[0]].copy_(x.k_cache)
        if not mla:
            svc[: x.v_cache.shape[0]].copy_(x.v_cache)
        bt = torch.zeros(4, width, dtype=torch.int32, device=DEV)
        bt[:, : x.block_table.shape[1]] = x.block_table
        plan = attn.plan(x.query_start_loc, x.seq_lens, bt)
        eager, lse = attn(x.q, x.k, x.v, skc, svc, plan, return_lse=True)
        _check(s, cfg, dt, eager, lse, f"step {i}, T = {x.q.shape[0]}")
        t = x.q.shape[0]
        if t not in graphs:
            sq, sk = x.q.clone(), x.k.clone()
            sv = None if mla else x.v.clone()
            graphs[t] = (*_graph(lambda q=sq, k=sk, v=sv, p=plan: attn(q, k, v, skc, svc, p)), sq, sk, sv)
        g, out, sq, sk, sv = graphs[t]
        sq.copy_(x.q)
        sk.copy_(x.k)
        if not mla:
            sv.copy_(x.v)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"step {i}, T = {t}: replay differs from eager"


@pytest.mark.parametrize("name", [n for n in backend_names()])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_strided_inputs_on_cuda(name, fmt):
    """q, k, v with stride 2 in the head dim and caches strided in pages, through the real kernels."""
    cfg = _served_config(name, fmt)
    step, x, attn, plan = _run(name, cfg, torch.bfloat16, [0, 100, 700, 2000], [3, 1, 4, 16], seed=8)
    q, k, v = (strided_last(t) for t in (x.q, x.k, x.v))
    out, lse = attn(q, k, v, strided_pages(x.k_cache), strided_pages(x.v_cache), plan, return_lse=True)
    _check(step, cfg, torch.bfloat16, out, lse, f"{name} {fmt} strided")


def test_write_new_tokens_in_a_cuda_graph():
    """The per-layer store of the step's K: no host sync (capturable), any cache strides."""
    cfg = _config("mla", 16, 64)
    step, x, attn, plan = _run("reference", cfg, torch.bfloat16, [100, 700], [4, 2], seed=6)
    big = torch.zeros(x.k_cache.shape[0], 2, *x.k_cache.shape[1:], dtype=torch.bfloat16, device=DEV)
    cache = big[:, 1]  # one layer's cache inside a (P, layers, page, H_kv, D) buffer
    g, _ = _graph(lambda: plan.write_new_tokens(cache, x.k))
    cache.zero_()
    g.replay()
    torch.cuda.synchronize()
    slots = plan.new_token_slots()
    flat = cache.reshape(-1, *cache.shape[2:])  # a copy: read only
    assert torch.equal(flat[slots[slots >= 0]], x.k[slots >= 0]) and big[:, 0].eq(0).all()


def test_write_new_tokens_refuses_capture_under_capture_limits():
    """A graph replayed after later plans would write the captured step's slots: refused, not silently wrong."""
    cfg = _config("mla", 16, 64)
    if "flashinfer" not in _serving(cfg, torch.bfloat16):
        pytest.skip("flashinfer not installed")
    limits = dict(max_batch_size=4, max_tokens=16, max_pages=64)
    _, x, _, plan = _run("flashinfer", cfg, torch.bfloat16, [100, 700], [4, 2], seed=6, limits=limits)
    plan.write_new_tokens(x.k_cache, x.k)  # eagerly: fine
    with pytest.raises(ValueError, match="expected write_new_tokens outside a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            plan.write_new_tokens(x.k_cache, x.k)


def test_a_gpu_this_machine_lacks_is_refused():
    cfg, n = _config("mla", 16, 64), torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"expected device 'cuda:{n}' to exist, but this machine has {n} GPU"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.bfloat16, device=f"cuda:{n}")


def test_auto_and_forced_refusals_on_this_gpu():
    mla = _spec(_config("mla", 16, 64), torch.bfloat16)
    best = select_backend(mla)
    assert best.name != "reference", "a GPU backend must serve MLA on any CUDA torch (torch_efficient)"
    with pytest.raises(ValueError, match=r"(?s)backend 'torch_flash' cannot serve .*kv_format 'mla' not in"):
        select_backend(mla, "torch_flash")
    print(
        "auto picks",
        best.name,
        "for MLA;",
        select_backend(_spec(_config("gqa", 8, 64), torch.bfloat16)).name,
        "for GQA",
    )


# -- two GPUs, NCCL -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    """Eager checks first (saved after each case), then CUDA-graph capture of the same calls."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=90), device_id=dev
    )
    results, layers = [], []
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        # MLA through auto (flashinfer where installed), GQA through torch's FA2: two backends under NCCL;
        # then MLA with the fused query+merge kernel after each combine; then the expanded context pass.
        for fmt, il, combine, name, fuse, cpass in (
            ("mla", 1, "a2a", "auto", False, "split"),
            ("mla", 64, "ag_rs", "auto", False, "split"),
            ("gqa", 1, "ag_rs", "torch_flash", False, "split"),
            ("gqa", 16, "a2a", "torch_flash", False, "split"),
            ("mla", 4, "a2a", "auto", True, "split"),
            ("mla", 16, "ag_rs", "auto", True, "split"),
            ("mla", 2, "a2a", "auto", None, "expand"),
            ("gqa", 8, "ag_rs", "torch_flash", None, "expand"),
        ):
            heads = 16 if fmt == "mla" else 8
            cfg = _config(fmt, heads, 64)
            mla, dt = fmt == "mla", torch.bfloat16
            ctx, ql = [0, 1, 70, 1000, 2900], [3, 1, 8, 4, 2]
            step = synthetic.make_step(
                ctx,
                ql,
                heads=heads * world,
                head_dim=cfg.head_dim,
                head_dim_v=cfg.head_dim_v,
                kv_heads=cfg.num_kv_heads,
                mla=mla,
                dtype=dt,
                seed=il,
            )
            layout = DCPLayout(world, rank, il)
            x = synthetic.rank_inputs(step, layout, 64, mla=mla, dtype=dt, device=dev, seed=il)
            attn = TwoStageAttention(
                cfg,
                layout,
                group=dist.group.WORLD,
                combine=combine,
                backend=name,
                dtype=dt,
                device=dev,
                fuse_query=fuse,
                context_pass=cpass,
            )
            plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
            assert (plan.context_plan is not None) == (cpass == "expand")
            out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
            ref_o, ref_lse = synthetic.oracle(step, cfg.scale, slice(rank * heads, (rank + 1) * heads))
            rel = ((out.double().cpu() - ref_o).abs().max() / ref_o.abs().max()).item()
            lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
            results.append(
                dict(
                    fmt=fmt,
                    il=il,
                    combine=combine,
                    backend=attn.backend.name,
                    fuse=fuse,
                    context_pass=cpass,
                    rel=rel,
                    lse_err=lse_err,
                    graph=None,
                )
            )
            layers.append((attn, x, plan, out))
            torch.save(results, path)
            print(f"rank {rank} eager {results[-1]}", flush=True)
        dist.barrier()
        for r, (attn, x, plan, out) in zip(results, layers):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan)
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            r["graph"] = bool(torch.equal(gout, out))
            torch.save(results, path)
            print(f"rank {rank} graph {r}", flush=True)
        # Ranks that disagree on the step: every rank raises in plan(), none is left waiting; then a good step.
        attn, x, plan, out = layers[0]
        try:
            attn.plan(x.query_start_loc, x.seq_lens + rank, x.block_table)
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        again = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        after = bool(torch.equal(attn(x.q, x.k, x.v, x.k_cache, x.v_cache, again), out))
        results.append(dict(refused=refused, after=after))
        torch.save(results, path)
        print(f"rank {rank} {results[-1]}", flush=True)
    finally:
        torch.save(results, path)
        dist.destroy_process_group()


def test_agree_over_nccl_on_one_gpu():
    """The agreement's all-reduce on an NCCL group: the layer's GPU, or the current one where the device
    given names none or is not valid (a rank whose setup was refused)."""
    import torch.distributed as dist

    from twostage_mla import comm

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            for device in (DEV, "cuda", None, "not a device", torch.device("cpu")):
                assert comm.agree("step", [1, -2, 3], dist.group.WORLD, device) == [[1, -2, 3]], device
            assert comm.agree("layer", [0, 2**62], dist.group.WORLD, DEV) == [[0, 2**62]]
        finally:
            dist.destroy_process_group()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fuse", [False, True], ids=["backend-query", "fused-query"])
def test_a_layer_on_a_gpu_that_is_not_the_current_one(fuse):
    """Triton (the fused kernel, the merge) launches on the current GPU: the layer makes its own current."""
    cfg, dt, dev = _config("mla", 16, 64), torch.bfloat16, torch.device("cuda", 1)
    step = synthetic.make_step([100, 0, 2000], [4, 2, 3], heads=16, head_dim=576, head_dim_v=512, dtype=dt, seed=6)
    x = synthetic.rank_inputs(step, DCPLayout(), 64, mla=True, dtype=dt, device=dev, seed=6)
    torch.cuda.set_device(0)
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=dt, device=dev, fuse_query=fuse)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    out, lse = attn(x.q, x.k, None, x.k_cache, None, plan, return_lse=True)
    assert torch.cuda.current_device() == 0 and out.device == dev
    _check(step, cfg, dt, out, lse, f"{attn.backend.name} on cuda:1")


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_nccl_layer_matches_oracle():
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(
            _nccl_worker, args=(2, f"tcp://127.0.0.1:{_free_port()}", d), nprocs=2, start_method="spawn", join=False
        )
        deadline = time.time() + 180
        finished = False
        while time.time() < deadline and not finished:
            try:
                finished = ctx.join(timeout=5)
            except Exception as e:  # a rank raised: keep what the ranks saved, then report
                print("worker failed:", e)
                finished = True
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        results = [
            torch.load(os.path.join(d, f"{r}.pt")) if os.path.exists(os.path.join(d, f"{r}.pt")) else []
            for r in range(2)
        ]
    for rank, res in enumerate(results):
        for r in res:
            print(f"rank {rank}: {r}")
    for rank, res in enumerate(results):
        assert len(res) == 9, f"rank {rank} stopped early ({'timed out' if not finished else 'error'}): {res}"
        last = res.pop()
        assert re.search(r"seq_lens|every rank of the DCP group", last["refused"]) and last["after"], last
        for r in res:
            assert r["rel"] < TOL[torch.bfloat16] and r["lse_err"] < LSE_TOL, r
            assert r["graph"] is True, r
