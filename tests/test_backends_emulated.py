"""The fast backends' glue on the CPU, with the GPU kernels replaced by stand-ins.

tests/_emulated_kernels.py implements each kernel's documented contract
(lse layout and base, what rows with no keys hold); here every backend runs
through the whole layer against the float64 oracle, and its two passes
against the reference backend on a sharded rank (N = 2). The real kernels
are exercised by tests/test_backends_gpu.py on a GPU.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

from tests import _emulated_kernels as emu
from tests._views import strided_last, strided_pages
from tests.dist_helpers import run_ranks
from twostage_mla import synthetic
from twostage_mla.backends import backend_names, base, refusals, select_backend, torch_efficient, torch_flash
from twostage_mla.backends import flashinfer as fi_backend
from twostage_mla.backends.base import AttentionSpec, CaptureLimits
from twostage_mla.backends.flash_attn import FlashAttn2Backend, FlashAttn3Backend
from twostage_mla.backends.flashinfer import FlashInferBackend
from twostage_mla.backends.reference import ReferenceBackend
from twostage_mla.backends.torch_efficient import TorchEfficientBackend
from twostage_mla.backends.torch_flash import TorchFlashBackend
from twostage_mla.layer import AttentionConfig, TwoStageAttention, _spec
from twostage_mla.layout import DCPLayout, local_pages
from twostage_mla.plan import plan_step

FAST = {
    "flashinfer": FlashInferBackend,
    "flash_attn3": FlashAttn3Backend,
    "flash_attn2": FlashAttn2Backend,
    "torch_flash": TorchFlashBackend,
    "torch_efficient": TorchEfficientBackend,
}


@pytest.fixture
def emulated(monkeypatch):
    """Route every backend's kernel calls to the CPU stand-ins."""
    fake_fi = emu.fake_flashinfer()
    monkeypatch.setattr(fi_backend, "_flashinfer", lambda: fake_fi)
    monkeypatch.setattr(torch_efficient, "_efficient_attention_forward", emu.efficient_attention_forward)
    monkeypatch.setattr(torch_flash, "_flash_attention_forward", emu.flash_attention_forward)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", emu.fake_flash_attn_interface())
    monkeypatch.setitem(sys.modules, "flash_attn", emu.fake_flash_attn())


def _config(mla: bool, page_size: int, heads: int = 4) -> AttentionConfig:
    if mla:
        return AttentionConfig.mla(num_heads=heads, kv_lora_rank=64, rope_dim=16, page_size=page_size, scale=0.11)
    return AttentionConfig(
        num_heads=heads, head_dim=32, head_dim_v=32, page_size=page_size, scale=0.17, num_kv_heads=2, kv_format="gqa"
    )


def _layer(name: str, cfg: AttentionConfig, layout: DCPLayout, limits: CaptureLimits | None = None,
           context_pass: str = "split"):
    attn = TwoStageAttention(cfg, layout, backend="reference", dtype=torch.float32, device="cpu",
                             context_pass=context_pass)
    attn.backend = FAST[name](attn.spec, limits)  # bypass the device check: the kernels are stand-ins
    return attn


def _cases(name: str) -> list[tuple[bool, int, bool]]:
    """(mla, page_size, tree) cases a backend serves."""
    kinds = FAST[name].kv_formats
    page = 256 if name == "flash_attn2" else 16
    out = []
    if "mla" in kinds:
        out += [(True, page, False), (True, page, True)]
    if "gqa" in kinds:
        out += [(False, page, False), (False, page, True)]
    if name == "torch_flash":
        out.append((False, 256, False))  # the paged (block_table) path of torch >= 2.12
    return out


# Tree steps are refused by the expanded pass (tests/test_layer.py).
@pytest.mark.parametrize(
    "name,mla,page_size,tree,context_pass",
    [(n, *c, cp) for n in FAST for c in _cases(n) for cp in ("split", "expand") if not (c[2] and cp == "expand")],
    ids=lambda x: str(x),
)
def test_layer_matches_oracle(emulated, name, mla, page_size, tree, context_pass):
    cfg = _config(mla, page_size)
    step = synthetic.make_step(
        [0, 5, 37, 100, 1, 2 * page_size],  # the last: a full last page (FlashInfer's last_page_len = page_size)
        [3, 1, 4, 2, 5, 2],
        heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim_v,
        kv_heads=cfg.num_kv_heads,
        mla=mla,
        tree=tree,
        seed=3,
    )
    x = synthetic.rank_inputs(step, DCPLayout(), page_size, mla=mla, dtype=torch.float32, device="cpu")
    attn = _layer(name, cfg, DCPLayout(), context_pass=context_pass)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    assert (plan.context_plan is not None) == (context_pass == "expand")
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    ref_o, ref_lse = synthetic.oracle(step, cfg.scale)
    assert torch.allclose(out.double(), ref_o, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("heads,batch,q_len,limits,expands", [
    (128, 32, 4, None, True), (128, 64, 2, None, True), (64, 32, 8, None, True), (128, 32, 2, None, False),
    (128, 8, 8, None, False), (64, 32, 4, None, False), (32, 16, 32, None, False),
    (128, 32, 4, CaptureLimits(32, 128, 4096), False), (128, 128, 1, None, True), (16, 32, 1, None, True),
    (16, 32, 1, CaptureLimits(32, 32, 4096), False), (16, 32, 2, None, False),
])  # fmt: skip
def test_flashinfer_auto_expands_where_it_measured_faster(emulated, heads, batch, q_len, limits, expands):
    # Measured on an H100 (docs/performance.md): 16384 packed rows (tokens x heads) and 256 a request, 64+ heads;
    # or one token per request (the expanded pass reads the cache once, and saves the query merge).
    cfg = _config(True, 16, heads)
    ctx = [(0, 30, 70)[b % 3] for b in range(batch)]
    step = synthetic.make_step(ctx, [q_len] * batch, heads=heads, head_dim=cfg.head_dim,
                               head_dim_v=cfg.head_dim_v, seed=4)  # fmt: skip
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    attn = _layer("flashinfer", cfg, DCPLayout(), limits, context_pass="auto")
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    assert (plan.context_plan is not None) == expands
    out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
    ref_o, ref_lse = synthetic.oracle(step, cfg.scale)
    assert torch.allclose(out.double(), ref_o, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("name,mla", [(n, *c[:1]) for n in FAST for c in _cases(n)[:3:2]], ids=lambda x: str(x))
def test_strided_inputs(emulated, name, mla):
    """q, k, v as views with stride 2 in the head dim, caches strided in pages: what kernels read is copied
    where they need stride 1 (q, k, v), or read as it is (the caches)."""
    cfg = _config(mla, 256 if name == "flash_attn2" else 16)
    step = synthetic.make_step([0, 5, 37, 100], [3, 1, 4, 2], heads=cfg.num_heads, head_dim=cfg.head_dim,
                               head_dim_v=cfg.head_dim_v, kv_heads=cfg.num_kv_heads, mla=mla, seed=4)  # fmt: skip
    x = synthetic.rank_inputs(step, DCPLayout(), cfg.page_size, mla=mla, dtype=torch.float32, device="cpu")
    attn = _layer(name, cfg, DCPLayout())
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    q, k, v = strided_last(x.q), strided_last(x.k), strided_last(x.v)
    assert q.stride(-1) == 2 and torch.equal(q, x.q)
    out = attn(q, k, v, strided_pages(x.k_cache), strided_pages(x.v_cache), plan)
    ref_o, _ = synthetic.oracle(step, cfg.scale)
    assert torch.allclose(out.double(), ref_o, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expected k_cache with stride 1 in its last dim, got strides \("):
        attn(x.q, x.k, x.v, strided_last(x.k_cache), x.v_cache, plan)


@pytest.mark.parametrize(
    "name,mla", [(n, m) for n in FAST for m in (True, False) if ("mla" if m else "gqa") in FAST[n].kv_formats]
)
def test_passes_match_reference_on_a_shard(emulated, name, mla):
    """Rank 1 of N = 2, interleave 2: each pass equals the reference backend's, rows with no context included."""
    page = 256 if name == "flash_attn2" else 8
    cfg = _config(mla, page)
    layout = DCPLayout(world_size=2, rank=1, interleave=2)
    ctx, ql = [0, 1, 2, 3, 9, 40], [2, 1, 3, 1, 2, 4]  # contexts 0..2 leave rank 1 with nothing
    step = synthetic.make_step(
        ctx,
        ql,
        heads=2 * cfg.num_heads,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim_v,
        kv_heads=cfg.num_kv_heads,
        mla=mla,
        seed=5,
    )
    x = synthetic.rank_inputs(step, layout, page, mla=mla, dtype=torch.float32, device="cpu")
    plan = plan_step(x.query_start_loc, x.seq_lens, x.block_table, page_size=page, layout=layout)
    spec = AttentionSpec(
        cfg.kv_format,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.head_dim_v,
        page,
        2,
        cfg.scale,
        torch.float32,
        torch.device("cpu"),
    )
    fast, ref = FAST[name](spec), ReferenceBackend(spec)
    fplan = plan.__class__(**{**plan.__dict__, "backend_state": fast.plan(plan)})
    rplan = plan.__class__(**{**plan.__dict__, "backend_state": ref.plan(plan)})
    v, v_cache = (x.k[..., : cfg.head_dim_v], x.k_cache[..., : cfg.head_dim_v]) if mla else (x.v, x.v_cache)
    q_all = step.q.to(torch.float32)  # (T, 2H, D): the gathered queries of both ranks
    for got, want in (
        (fast.context(q_all, x.k_cache, v_cache, fplan), ref.context(q_all, x.k_cache, v_cache, rplan)),
        (fast.query(x.q, x.k, v, fplan), ref.query(x.q, x.k, v, rplan)),
    ):
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        assert got[1].dtype == torch.float32
        assert torch.allclose(got[0], want[0], atol=1e-5), name
        assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
        fin = torch.isfinite(want[1])
        assert torch.allclose(got[1][fin], want[1][fin], atol=1e-5)


def test_flashinfer_stale_plan_and_capture_limits(emulated):
    cfg = _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    attn = _layer("flashinfer", cfg, DCPLayout())
    old = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    with pytest.raises(ValueError, match="latest plan"):
        attn(x.q, x.k, None, x.k_cache, None, old)
    latest = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    attn.backend.invalidate_plans()  # what plan() does on every rank after a step the group refused
    with pytest.raises(ValueError, match="latest plan"):
        attn(x.q, x.k, None, x.k_cache, None, latest)

    small = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(max_batch_size=2, max_tokens=4, max_pages=2))
    with pytest.raises(ValueError, match="max_pages = 2"):
        small.plan(x.query_start_loc, x.seq_lens, x.block_table)
    ok = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(max_batch_size=4, max_tokens=8, max_pages=8))
    plan = ok.plan(x.query_start_loc, x.seq_lens, x.block_table)
    out = ok(x.q, x.k, None, x.k_cache, None, plan)
    ref_o, _ = synthetic.oracle(step, cfg.scale)
    assert torch.allclose(out.double(), ref_o, atol=1e-5)


# (contexts, q_lens): chains and a chunk of 70 tokens; batches of two thirds and of half empty requests (an
# engine's padding), where FlashInfer picks row tiles of 64 at 128 heads (64 rows a request: not over 64).
HEAD_COUNT_STEPS = [([0, 40, 3], [16, 70, 5]), ([5, 3, 0], [1, 0, 0]), ([3, 0], [1, 0])]


@pytest.mark.parametrize("steps", [0, 1, 2], ids=["chunk", "empty-requests", "half-empty"])
@pytest.mark.parametrize("heads", [4, 10, 40, 64, 96, 127, 128, 129, 256])
def test_flashinfer_mla_query_pass_at_any_head_count(emulated, heads, steps):
    """FlashInfer's causal MLA kernel drops keys at some head counts (the stand-in drops them as the H200's
    kernel did); the layer's query pass stays exact at every count."""
    cfg = _config(True, 16, heads=heads)
    step = synthetic.make_step(*HEAD_COUNT_STEPS[steps], heads=heads, head_dim=cfg.head_dim,
                               head_dim_v=cfg.head_dim_v, mla=True, seed=heads)  # fmt: skip
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    ref_o, ref_lse = synthetic.oracle(step, cfg.scale)
    exact = []
    for own_kernel in (None, True):  # the backend's choice, then FlashInfer's kernel forced at every count
        attn = _layer("flashinfer", cfg, DCPLayout())
        if own_kernel:
            attn.backend._exact = {64: True, 128: True}
        out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table),
                        return_lse=True)  # fmt: skip
        exact.append(torch.allclose(out.double(), ref_o, atol=1e-5, rtol=1e-5)
                     and torch.allclose(lse.double(), ref_lse, atol=1e-5))  # fmt: skip
    assert exact[0]
    # The kernel alone, on these steps: wrong at these counts (with the empty requests, tiles of 64 rows:
    # the first tile of any count over 64 reads no key).
    assert exact[1] == (heads not in (127, 129, 256) if steps == 0 else heads <= 64)


def test_flashinfer_exactness_rule_agrees_with_the_h200():
    """_causal_mla_exact against FlashInfer's kernel as measured on an H200 (benchmarks/fi_mla_causal_probe.py,
    one request per case): every no-context case it calls exact was exact there."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "h200_2026-12-02_fi_mla_causal_session19.json")  # fmt: skip
    with open(path) as f:
        cases = [c for c in json.load(f) if c["context"] == 0]
    assert len(cases) == 160 and sum(c["wrong"] for c in cases) > 0
    for c in cases:
        tile = 128 if c["q_len"] * c["heads"] > 64 else 64  # one request: its own rows are the average
        if fi_backend._causal_mla_exact(c["heads"], tile):
            assert not c["wrong"], c


def test_flashinfer_refuses_the_dense_query_pass_under_capture_limits(emulated):
    """The dense pass that stands in for FlashInfer's causal MLA kernel cannot replay across plans: refused by name
    where it would run, at construction where it always would (256 heads), at plan time where a step needs it
    (128 heads, half the requests or more empty)."""
    limits = CaptureLimits(max_batch_size=4, max_tokens=96, max_pages=8)
    for heads in (40, 128, 256):
        cfg = _config(True, 16, heads=heads)
        spec = _spec(cfg, 1, torch.float32, torch.device("cpu"))
        FlashInferBackend(spec, limits).use_query_pass(False)  # the fused query pass: nothing to refuse
        FlashInferBackend(spec).use_query_pass(True)  # no limits: the dense pass serves
        if heads == 256:
            with pytest.raises(ValueError, match=r"expected the fused query pass .* at 256 heads, got the backend.s"):
                FlashInferBackend(spec, limits).use_query_pass(True)
            continue
        attn = _layer("flashinfer", cfg, DCPLayout(), limits)
        for ctx, ql in HEAD_COUNT_STEPS:
            step = synthetic.make_step(ctx, ql, heads=heads, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                                       mla=True, seed=1)  # fmt: skip
            x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
            if heads == 128 and sum(ql) == 1:
                want = rf"at this step, got the backend's own: at 1 tokens x 128 heads over {len(ql)} requests"
                with pytest.raises(ValueError, match=want + r" .* tiles of 64 rows"):
                    attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
                continue
            out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
            assert torch.allclose(out.double(), synthetic.oracle(step, cfg.scale)[0], atol=1e-5, rtol=1e-5)


def test_the_layer_tells_its_backend_whether_it_runs_the_query_pass(monkeypatch):
    """use_query_pass is how a backend refuses a query pass it cannot serve: the layer must call it."""
    told = []
    monkeypatch.setattr(ReferenceBackend, "use_query_pass", lambda self, on: told.append(on))
    TwoStageAttention(_config(True, 16), DCPLayout(), backend="reference", dtype=torch.float32, device="cpu")
    assert told == [True]  # on the CPU no fused kernel: the backend's own query pass


def _stale_plan_on_two_ranks(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from twostage_mla import comm

    fi_backend._flashinfer = lambda: emu.fake_flashinfer()  # this worker process only
    gathers = []
    gather = comm.gather_queries
    comm.gather_queries = lambda q, group: gathers.append(1) or gather(q, group)
    layout, cfg = DCPLayout(world, rank, 1), _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4 * world, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, layout, 16, mla=True, dtype=torch.float32, device="cpu")
    said = []
    for fuse in (False, True):
        attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, backend="reference", dtype=torch.float32)
        attn.backend = FlashInferBackend(attn.spec, None)
        if fuse:
            _fused(attn)
        old = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        try:
            attn(x.q, x.k, None, x.k_cache, None, old)
        except ValueError as e:
            said.append(f"{len(gathers)} gathers: {e}")
    return said


def test_a_stale_flashinfer_plan_is_refused_before_any_collective():
    # The ranks would otherwise sit in the query all-gather, which the refusing rank never waits on.
    pytest.importorskip("triton")
    for said in run_ranks(2, _stale_plan_on_two_ranks):
        assert len(said) == 2 and all(m.startswith("0 gathers: expected the latest plan") for m in said), said


@pytest.mark.parametrize("name", list(FAST))
def test_a_step_with_no_context(emulated, name):
    # A first prefill chunk: every request's keys are the step's own, no kernel over an empty cache
    # (FlashInfer plans none), and under capture limits FlashInfer's kernel runs and its rows are masked.
    for mla, page_size, _ in _cases(name)[::2]:
        cfg = _config(mla, page_size)
        step = synthetic.make_step([0, 0, 0], [3, 1, 5], heads=4, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                                   kv_heads=cfg.num_kv_heads, mla=mla, seed=7)  # fmt: skip
        x = synthetic.rank_inputs(step, DCPLayout(), page_size, mla=mla, dtype=torch.float32, device="cpu")
        limits = [None, CaptureLimits(4, 16, 8)] if name == "flashinfer" else [None]
        for lim in limits:
            attn = _layer(name, cfg, DCPLayout(), lim)
            plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
            if name == "flashinfer":
                assert plan.backend_state.context == (lim is not None)
            out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
            ref_o, ref_lse = synthetic.oracle(step, cfg.scale)
            assert torch.allclose(out.double(), ref_o, atol=1e-5), (mla, lim)
            assert torch.allclose(lse.double(), ref_lse, atol=1e-5), (mla, lim)


def _fused(attn):
    from twostage_mla.kernels.query_merge import query_merge_triton

    attn.query_merge, attn.backend.query_pass = query_merge_triton, False  # what fuse_query picks on CUDA
    return attn


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter path; GPU tests cover CUDA")
def test_capture_limits_with_the_fused_query_pass(emulated):
    # The fused kernel (Triton's interpreter here) reads the step's indices and tree mask, which a
    # graph captured at one step must find refilled at the next: same B and T, other q_lens, trees
    # after chains and a chain after trees (requests of up to 16 tokens: one fixed mask, causal on chains).
    pytest.importorskip("triton")
    cfg = _config(True, 16)
    attn = _fused(_layer("flashinfer", cfg, DCPLayout(), CaptureLimits(max_batch_size=2, max_tokens=8, max_pages=8)))
    steps = [
        synthetic.make_step([10, 30], ql, heads=4, head_dim=80, head_dim_v=64, tree=tree, seed=i)
        for i, (ql, tree) in enumerate(
            (([2, 6], False), ([5, 3], False), ([5, 3], True), ([1, 7], True), ([4, 4], False))
        )
    ]
    xs = [synthetic.rank_inputs(s, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu") for s in steps]
    plans = []
    for s, x in zip(steps, xs):
        plans.append(attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents))
        if x.parents is None:  # a chain: the causal mask
            assert plans[-1].fused_plan.query_mask[0].tolist() == torch.ones(8, 8, dtype=torch.bool).tril().tolist()
        out = attn(x.q, x.k, None, x.k_cache, None, plans[-1])
        assert torch.allclose(out.double(), synthetic.oracle(s, cfg.scale)[0], atol=1e-5)
    for name in ("token_offset", "token_request", "query_start_loc", "query_mask"):  # one buffer each, refilled
        assert len({getattr(p.fused_plan, name).data_ptr() for p in plans}) == 1, name
    assert plans[-1].fused_plan.token_offset.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="latest plan"):
        attn(xs[0].q, xs[0].k, None, xs[0].k_cache, None, plans[0])
    # An older plan's own fields stay its own (an engine may plan the next step before writing this one's K).
    assert plans[0].query_start_loc.tolist() == [0, 2, 8] and plans[0].token_offset.tolist()[:3] == [0, 1, 0]
    unlimited = _fused(_layer("flashinfer", cfg, DCPLayout()))
    fresh = unlimited.plan(xs[0].query_start_loc, xs[0].seq_lens, xs[0].block_table)
    assert torch.equal(plans[0].new_token_slots(), fresh.new_token_slots())
    # A plan of another B has wrappers of its own, but the layer's fixed buffers are shared: refused too.
    one = synthetic.make_step([12], [3], heads=4, head_dim=80, head_dim_v=64, seed=9)
    x1 = synthetic.rank_inputs(one, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    p1 = attn.plan(x1.query_start_loc, x1.seq_lens, x1.block_table)
    attn.plan(xs[4].query_start_loc, xs[4].seq_lens, xs[4].block_table)
    with pytest.raises(ValueError, match="latest plan of the layer that made it"):
        attn(x1.q, x1.k, None, x1.k_cache, None, p1)
    # Another layer of the same config may run the latest plan (one plan per step for all layers).
    twin = _fused(_layer("flashinfer", cfg, DCPLayout(), CaptureLimits(max_batch_size=2, max_tokens=8, max_pages=8)))
    p1 = attn.plan(x1.query_start_loc, x1.seq_lens, x1.block_table)
    out = twin(x1.q, x1.k, None, x1.k_cache, None, p1)
    assert torch.allclose(out.double(), synthetic.oracle(one, cfg.scale)[0], atol=1e-5)
    # The kernel compiled for requests of up to max_q_len tokens: a longer one is refused.
    tight = _fused(_layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 8, 8, max_q_len=4)))
    with pytest.raises(ValueError, match=r"at most max_q_len = 4 tokens \(capture limits\), got one of 5"):
        tight.plan(xs[1].query_start_loc, xs[1].seq_lens, xs[1].block_table)
    # No fixed mask where requests may be longer than 16 tokens, or the query pass is the backend's.
    long = _fused(_layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 32, 8)))
    unfused = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 8, 8))
    for layer, why in ((long, "fused=True, max_q_len = 32"), (unfused, "fused=False, max_q_len = 8")):
        with pytest.raises(ValueError, match=f"no tree parents with capture limits .*got {why}"):
            layer.plan(xs[2].query_start_loc, xs[2].seq_lens, xs[2].block_table, parents=xs[2].parents)
    # ... while requests of up to 16 tokens, the most one fixed mask holds, still take trees.
    edge = _fused(_layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 32, 8, max_q_len=16)))
    x = xs[2]
    plan = edge.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    out = edge(x.q, x.k, None, x.k_cache, None, plan)
    assert torch.allclose(out.double(), synthetic.oracle(steps[2], cfg.scale)[0], atol=1e-5)
    x = xs[1]
    out = long(x.q, x.k, None, x.k_cache, None, long.plan(x.query_start_loc, x.seq_lens, x.block_table))
    assert torch.allclose(out.double(), synthetic.oracle(steps[1], cfg.scale)[0], atol=1e-5)
    # A plan holds what its layer's kernels need: a layer without the fused kernel or the limits refuses it.
    for other in (unfused, unlimited):
        with pytest.raises(ValueError, match=r"expected plan from plan\(\) of a layer with this config .*fused="):
            other(x.q, x.k, None, x.k_cache, None, long.plan(x.query_start_loc, x.seq_lens, x.block_table))
    # An empty step is checked against the limits too (FlashInfer plans nothing for it).
    three = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"within max_batch_size = 2 \(the layer's capture limits\), got 3"):
        attn.plan(three, torch.tensor([5, 6, 7], dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32))


@pytest.mark.parametrize("mla", [False, True])
def test_capture_limits_steps_of_one_batch_size_and_more_tokens(emulated, mla):
    # Decode (T = B) then verification (T = 3B) at the same B, as engines run them: FlashInfer's
    # prefill wrappers (GQA) fix their row count at the first plan in CUDA-graph mode.
    cfg = _config(mla, 16)
    attn = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(max_batch_size=4, max_tokens=16, max_pages=32))
    for ctx, ql in (([10, 40], [1, 1]), ([10, 40], [3, 3]), ([20, 5], [1, 1])):
        step = synthetic.make_step(ctx, ql, heads=4, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                                   kv_heads=cfg.num_kv_heads, mla=mla, seed=sum(ql))  # fmt: skip
        x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=mla, dtype=torch.float32, device="cpu")
        out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
        assert torch.allclose(out.double(), synthetic.oracle(step, cfg.scale)[0], atol=1e-5)


def test_capture_limits_are_checked():
    with pytest.raises(ValueError, match="max_tokens"):
        CaptureLimits(max_batch_size=2, max_tokens=0, max_pages=3)
    with pytest.raises(ValueError, match="got max_batch_size without max_tokens, max_pages"):
        CaptureLimits(max_batch_size=2)
    assert not CaptureLimits().given and CaptureLimits(1, 2, 3).given
    with pytest.raises(ValueError, match="max_q_len to be None or a positive int, got True"):
        CaptureLimits(2, 8, 8, max_q_len=True)
    assert CaptureLimits(2, 8, 8, max_q_len=64).longest_request == 8  # no request is longer than a step
    np = pytest.importorskip("numpy")
    assert CaptureLimits(np.int64(2), np.int32(8), np.int64(8)) == CaptureLimits(2, 8, 8)


def test_auto_and_forced_selection_on_cpu():
    spec = AttentionSpec("mla", 16, 1, 576, 512, 64, 1, 0.1, torch.bfloat16, torch.device("cpu"))
    assert select_backend(spec) is ReferenceBackend
    for name in FAST:
        with pytest.raises(ValueError, match=f"backend '{name}' cannot serve") as e:
            select_backend(spec, name)
        assert "device 'cpu' not in" in str(e.value)
    with pytest.raises(ValueError, match="kv_format 'mla' not in"):
        select_backend(spec, "torch_flash")


def test_a_release_older_than_the_backend_was_written_for_is_refused(monkeypatch):
    import importlib.metadata
    import importlib.util

    spec = AttentionSpec("gqa", 8, 2, 128, 128, 256, 1, 0.1, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # every package "installed"
    versions = {"flashinfer-python": "0.4.0rc2", "flash-attn": "2.6.0.post1"}
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: versions[dist])
    read_once = base._installed_version  # cached per process: cleared around the made-up versions
    read_once.cache_clear()
    try:
        assert FlashInferBackend.environment_problems(spec) == [
            "flashinfer-python 0.4.0rc2 is older than 0.5.3, the oldest release it was written for"
        ]
        assert FlashAttn2Backend.environment_problems(spec) == []  # 2.6.0.post1 >= 2.6
        read_once.cache_clear()
        versions["flashinfer-python"] = "0.10.1"  # compared as numbers, not as text
        assert FlashInferBackend.environment_problems(spec) == []
    finally:
        read_once.cache_clear()


def test_a_stub_module_without_a_spec_does_not_break_the_registry(monkeypatch):
    # Test doubles put modules with no __spec__ into sys.modules, where find_spec raises ValueError.
    import types

    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("flash_attn_interface"))
    spec = AttentionSpec("mla", 2, 1, 48, 32, 16, 1, 0.2, torch.float32, torch.device("cpu"))
    assert not any("flash_attn_interface" in why for why in FlashAttn3Backend.environment_problems(spec))
    assert select_backend(spec, "auto") is ReferenceBackend  # FA3 is there, but serves no CPU


def test_fa3_declares_only_the_head_dims_its_kernel_takes():
    # FA3's mha_fwd takes a V head dim other than K's only in two ranges: others are refused at selection.
    def spec(d, dv):
        return AttentionSpec("gqa", 8, 2, d, dv, 16, 1, 0.1, torch.bfloat16, torch.device("cpu"))

    for d, dv in ((128, 64), (256, 128)):
        assert "differ only as" in " ".join(FlashAttn3Backend.extra_reasons(spec(d, dv)))
    for d, dv in ((128, 128), (192, 128), (64, 256)):
        assert FlashAttn3Backend.extra_reasons(spec(d, dv)) == []


def test_torch_efficient_refuses_bf16_before_sm80(monkeypatch):
    # torch's memory-efficient kernel has no bf16 variant before sm80: refused at selection (auto
    # falls back), not at the first layer call.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cc, refused in (((7, 5), True), ((8, 0), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        for dtype in (torch.bfloat16, torch.float16):
            spec = AttentionSpec("mla", 16, 1, 576, 512, 64, 1, 0.1, dtype, torch.device("cuda", 0))
            why = " ".join(TorchEfficientBackend.environment_problems(spec))
            assert ("bf16 needs compute capability >= (8, 0)" in why) == (refused and dtype == torch.bfloat16), why


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dense_attention_spreads_a_bad_value_only_to_rows_that_see_it(bad):
    # The reference's maths and every backend's tree query pass: 0 x NaN must not reach a row
    # whose mask hides the key (a later token, a tree sibling), and a row that sees it is NaN.
    from twostage_mla.backends._dense import dense_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 4, d, generator=g) for d in (8, 8, 6))
    k, v = k[:, :, :2], v[:, :, :2]  # 4 query heads over 2 KV heads
    v[0, 2, 1, 4] = bad  # key 2, KV head 1 (query heads 2 and 3), one value
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None]  # key 2 is seen by row 2 only
    o, lse = dense_attention(q, k, v, mask, 0.3)
    assert o[0, 2, 2:, 4].isnan().all() and not o[0, 2, 2:].isnan()[:, [0, 1, 2, 3, 5]].any()
    assert not o[0, :2].isnan().any() and not o[0, 2, :2].isnan().any() and lse.isfinite().all()
    clean, _ = dense_attention(q[:, :2], k[:, :2], v[:, :2], mask[:, :2, :2], 0.3)
    torch.testing.assert_close(o[:, :2], clean)


def test_reference_pads_each_request_at_most_to_twice_its_lengths():
    # A long chunk or a long context among short ones pads only its own group (not the batch).
    ctx, ql = [0, 3, 5, 7, 300, 40], [1, 1, 2, 1, 2, 200]
    step = synthetic.make_step(ctx, ql, heads=4, head_dim=80, head_dim_v=64, seed=2)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    plan = plan_step(x.query_start_loc, x.seq_lens, x.block_table, page_size=16, layout=DCPLayout())
    spec = TwoStageAttention(_config(True, 16), DCPLayout(), dtype=torch.float32).spec
    state = ReferenceBackend(spec).plan(plan)
    for groups, with_context in ((state.context, True), (state.query, False)):
        seen = []
        for g in groups:
            for b in g.requests.tolist():
                seen.append(b)
                assert g.tokens.shape[1] < 2 * ql[b] and (not with_context or g.slots.shape[1] < 2 * ctx[b])
        assert sorted(seen) == [b for b in range(6) if not with_context or ctx[b]]


def test_a_request_of_exactly_max_q_len_tokens_is_served(emulated):
    cfg = _config(True, 16)
    attn = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 8, 8, max_q_len=4))
    step = synthetic.make_step([10, 30], [4, 2], heads=4, head_dim=80, head_dim_v=64, seed=2)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    out = attn(x.q, x.k, None, x.k_cache, None, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
    assert torch.allclose(out.double(), synthetic.oracle(step, cfg.scale)[0], atol=1e-5)


def test_refusals_take_the_capture_limits():
    spec = AttentionSpec("mla", 2, 1, 24, 16, 4, 1, 0.2, torch.float32, torch.device("cpu"))
    assert refusals(spec)["reference"] == []
    why = refusals(spec, CaptureLimits(2, 8, 8))["reference"]
    assert any("keeps no metadata in fixed buffers" in w for w in why), why


def test_auto_tries_the_reference_last():
    names = backend_names()
    assert names[-1] == "reference" and names.index("torch_flash") < names.index("torch_efficient"), names


def test_the_minimum_compute_capability_itself_is_served(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = AttentionSpec("gqa", 8, 2, 128, 128, 256, 1, 0.1, torch.bfloat16, torch.device("cuda", 0))
    for cc, refused in (((7, 5), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        why = " ".join(TorchFlashBackend.environment_problems(spec))
        assert ("needs compute capability >= (8, 0)" in why) == refused, (cc, why)


def test_the_minimum_release_itself_is_served(monkeypatch):
    import importlib.metadata
    import importlib.util

    spec = AttentionSpec("gqa", 8, 2, 128, 128, 256, 1, 0.1, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.5.3")
    base._installed_version.cache_clear()
    try:
        assert FlashInferBackend.environment_problems(spec) == []
    finally:
        base._installed_version.cache_clear()


def test_fa2_refuses_a_page_size_that_is_no_multiple_of_256():
    for page, refused in ((384, True), (512, False)):
        spec = AttentionSpec("gqa", 8, 2, 128, 128, page, 1, 0.1, torch.bfloat16, torch.device("cuda", 0))
        why = " ".join(FlashAttn2Backend.not_supported_reasons(spec))
        assert (f"page_size {page} not a multiple of 256" in why) == refused, why


def test_flashinfer_counts_rank_0s_pages_against_max_pages_on_every_rank(emulated):
    # N = 2, I = 4, page 4, C = 12: rank 0 keeps positions 0-3 and 8-11 (2 pages), rank 1 keeps 4-7 (1 page).
    # Both ranks refuse the step, so neither goes on into a collective alone.
    cfg = _config(True, 4)
    assert [local_pages(12, 2, 4, r, 4) for r in (0, 1)] == [2, 1]
    for rank in (0, 1):
        plan = plan_step(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([13], dtype=torch.int32),
                         torch.zeros(1, 4, dtype=torch.int32), page_size=4, layout=DCPLayout(2, rank, 4))  # fmt: skip
        spec = AttentionSpec("mla", cfg.num_heads, 1, cfg.head_dim, cfg.head_dim_v, 4, 2, cfg.scale, torch.float32,
                             torch.device("cpu"))  # fmt: skip
        with pytest.raises(ValueError, match=r"within max_pages = 1 \(the layer's capture limits\), got 2"):
            FlashInferBackend(spec, CaptureLimits(4, 8, 1)).plan(plan)


def test_invalidate_plans_reaches_the_capture_mode_wrappers(emulated):
    cfg = _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    attn = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(4, 8, 8))
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    attn.backend.invalidate_plans()  # what plan() does on every rank after a step the group refused
    with pytest.raises(ValueError, match="latest plan"):
        attn(x.q, x.k, None, x.k_cache, None, plan)


@pytest.mark.parametrize("mla", [True, False])
def test_capture_mode_empty_rows_are_refilled_each_step(emulated, mla):
    # Step 1 has a request with no context (its rows masked to the empty state); step 2, same B and T,
    # has none: the fixed buffer must not keep step 1's rows.
    cfg = _config(mla, 16)
    attn = _layer("flashinfer", cfg, DCPLayout(), CaptureLimits(2, 8, 8))
    for ctx in ([0, 20], [10, 20]):
        step = synthetic.make_step(ctx, [2, 3], heads=4, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                                   kv_heads=cfg.num_kv_heads, mla=mla, seed=sum(ctx))  # fmt: skip
        x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=mla, dtype=torch.float32, device="cpu")
        out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
        assert torch.allclose(out.double(), synthetic.oracle(step, cfg.scale)[0], atol=1e-5), ctx


def test_flashinfer_plans_no_query_kernel_when_the_query_pass_is_fused(emulated):
    cfg = _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    attn = _layer("flashinfer", cfg, DCPLayout())
    attn.backend.query_pass = False  # what the layer sets with fuse_query
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    assert plan.backend_state.wrappers.ctx._planned and not plan.backend_state.wrappers.qry._planned


@pytest.mark.parametrize("sm90", [True, False])
def test_flashinfer_pins_the_mla_kernels_its_exactness_rule_models(emulated, sm90):
    """FlashInfer's "auto" may pick MLA kernels with other tiling in later releases (sm100): the backend asks
    for fa3 on sm90a and fa2 elsewhere, as 0.5.3's "auto" does, with and without capture limits."""
    fi_backend._flashinfer().utils.is_sm90a_supported = lambda device: sm90
    cfg = _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    for limits in (None, CaptureLimits(max_batch_size=4, max_tokens=16, max_pages=8)):
        attn = _layer("flashinfer", cfg, DCPLayout(), limits)
        wrappers = attn.plan(x.query_start_loc, x.seq_lens, x.block_table).backend_state.wrappers
        assert (wrappers.ctx.backend, wrappers.qry.backend) == (("fa3", "fa3") if sm90 else ("fa2", "fa2"))


def test_torch_flash_reads_pages_in_place_only_for_fa2_page_sizes(monkeypatch):
    monkeypatch.setattr(torch_flash, "_op_takes", lambda arg: True)  # a torch whose op takes block_table
    for page, paged in ((16, False), (256, True)):
        spec = AttentionSpec("gqa", 4, 2, 32, 32, page, 1, 0.17, torch.float16, torch.device("cpu"))
        assert TorchFlashBackend(spec)._paged_ok == paged, page


@pytest.mark.parametrize(
    "check",
    [
        lambda: test_layer_matches_oracle(None, "flashinfer", True, 16, False, "split"),
        lambda: test_layer_matches_oracle(None, "flashinfer", True, 16, False, "expand"),
        lambda: test_layer_matches_oracle(None, "flashinfer", True, 16, True, "split"),
        lambda: test_passes_match_reference_on_a_shard(None, "flashinfer", True),
        lambda: test_flashinfer_stale_plan_and_capture_limits(None),
        lambda: test_capture_mode_empty_rows_are_refilled_each_step(None, True),
    ],
    ids=["chain", "chain-expanded", "tree", "shard", "capture_limits", "empty_rows"],
)
def test_flashinfer_takes_the_keyword_mla_api_of_later_releases(emulated, monkeypatch, check):
    """FlashInfer 0.7.4's MLA wrapper (MLAPlanMetadata, keywords, the lse mode at plan time): the same checks
    pass through it, and its stand-in refuses 0.5.3's forms, which 0.7.4 only warns about."""
    fake = emu.fake_flashinfer(keywords=True)
    monkeypatch.setattr(fi_backend, "_flashinfer", lambda: fake)
    check()


@pytest.mark.parametrize("heads,tokens,ok", [(128, 16000, True), (128, 16320, False), (16, 16000, True)])
def test_flashinfer_refuses_steps_past_the_mla_planners_capacity(emulated, heads, tokens, ok):
    """FlashInfer's MLA planner keeps 16384 work items (0.5.3 overruns past them): a step that might need more
    is refused at plan time on every rank alike, here the context pass of 128 heads over one request (the
    bound: 16320 tiles of 128 rows, + 1 per request, + 66 clusters of splits)."""
    cfg = _config(True, 16, heads)
    ctx = [40]
    for rank in (0, 1):  # rank 1 has no context (40 < 2 x 64 tokens): it refuses too
        layout = DCPLayout(2, rank, 64)
        plan = plan_step(torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([ctx[0] + tokens]),
                         torch.zeros(1, 130, dtype=torch.int32), page_size=64, layout=layout)  # fmt: skip
        spec = AttentionSpec("mla", heads // 2, 1, cfg.head_dim, cfg.head_dim_v, 64, 2, cfg.scale, torch.float32,
                             torch.device("cpu"))  # fmt: skip
        backend = FlashInferBackend(spec)
        backend.query_pass = False  # the fused query pass: only the context pass reaches FlashInfer
        if ok:
            assert backend.plan(plan).wrappers.ctx._planned == (rank == 0)
            continue
        with pytest.raises(ValueError, match=r"within FlashInfer's MLA planner \(16384 work items\), got up to "
                                             r"16387 for the context pass at 16320 tokens x 128 heads "
                                             r"\(64 x 2 ranks\) in 1 request"):  # fmt: skip
            backend.plan(plan)


def test_flashinfer_refuses_a_query_pass_past_the_mla_planners_capacity(emulated):
    """A first prefill chunk (no context on any rank): only FlashInfer's own query pass would run, at the rank's
    128 heads, and it is the one refused; with the query pass fused, nothing reaches FlashInfer."""
    cfg = _config(True, 64, 128)
    for rank in (0, 1):
        table = torch.zeros(1, 260, dtype=torch.int32)
        plan = plan_step(torch.tensor([0, 16320], dtype=torch.int32), torch.tensor([16320]), table, page_size=64,
                         layout=DCPLayout(2, rank, 64))  # fmt: skip
        spec = AttentionSpec("mla", 128, 1, cfg.head_dim, cfg.head_dim_v, 64, 2, cfg.scale, torch.float32,
                             torch.device("cpu"))  # fmt: skip
        backend = FlashInferBackend(spec)
        with pytest.raises(ValueError, match=r"got up to 16387 for the query pass at 16320 tokens x 128 heads in"):
            backend.plan(plan)
        backend.query_pass = False
        assert backend.plan(plan).wrappers is not None


def _mlaplan_works(q_lens: list[int], kv_lens: list[int], heads: int, num_sm: int, causal: bool) -> int:
    """The work items of FlashInfer's MLAPlan (scheduler.cuh, 0.5.3 and 0.7.4 alike): a tile of packed rows
    each, times its key splits."""
    cluster = 2 if sum(q_lens) * heads // len(q_lens) > 64 else 1
    tile, clusters = 64 * cluster, num_sm // cluster
    keys = []  # per tile: the keys it reads (packed_causal_kv_end where causal)
    for q, kv in zip(q_lens, kv_lens):
        n = -(-q * heads // tile)
        keys += [max(min(kv - q + -(-(i + 1) * tile // heads), kv), 0) if causal and i + 1 < n else kv
                 for i in range(n)]  # fmt: skip
    avg = max(-(-sum(keys) // clusters), 1)
    limit = 32 if avg <= 8 else 64 if avg <= 16 else 128 if avg <= 32 else 192 if avg <= 64 else -(-avg // 256) * 256
    return sum(max(1, -(-k // limit)) for k in keys)


def test_mla_work_bound_is_an_upper_bound_of_the_planners_count():
    gen = random.Random(0)
    tight = 0
    for _ in range(4000):
        b = gen.randint(1, 40)
        heads = gen.choice([1, 3, 16, 40, 64, 100, 128, 256, 1024])
        q = [gen.choice([0, 1, 2, 4, 7, 16, gen.randint(0, 300)]) for _ in range(b)]
        q[0] = max(q[0], 1)
        causal = gen.random() < 0.5
        kv = list(q) if causal else [gen.choice([0, 1, 63, 64, 1000, gen.randint(0, 300000)]) for _ in range(b)]
        num_sm = gen.choice([8, 108, 132])
        works, bound = _mlaplan_works(q, kv, heads, num_sm, causal), fi_backend._mla_work_bound(sum(q), b, heads,
                                                                                                num_sm)  # fmt: skip
        assert works <= bound, (q, kv, heads, num_sm, causal)
        tight = max(tight, works - bound)
    assert tight >= -1  # the bound is within one work item of some step's count


def test_a_plan_flashinfer_refuses_halfway_ends_the_earlier_plan(emulated):
    """FlashInfer 0.7.4 refuses some plans (a causal tile boundary, int32 ranges): where the query pass's plan
    fails after the context pass's was replaced, an earlier step's plan must not run on that wrapper."""
    cfg = _config(True, 16)
    step = synthetic.make_step([10, 30], [2, 2], heads=4, head_dim=80, head_dim_v=64, seed=1)
    x = synthetic.rank_inputs(step, DCPLayout(), 16, mla=True, dtype=torch.float32, device="cpu")
    attn = _layer("flashinfer", cfg, DCPLayout())
    old = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    qry = old.backend_state.wrappers.qry

    def refuse(*args, **kw):
        raise RuntimeError("causal tile boundary is unsupported")

    qry.plan = refuse
    with pytest.raises(RuntimeError, match="causal tile boundary"):
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    with pytest.raises(ValueError, match="latest plan"):
        attn(x.q, x.k, None, x.k_cache, None, old)
