"""The fused query-pass + merge kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_ranks
from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, synthetic
from twostage_mla.state import merge_states

pytest.importorskip("triton")
from twostage_mla.kernels.query_merge import query_merge_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# H, H_kv, D, Dv; "gqa_wide_v": V wider than q and K (D < Dv)
SHAPES = {"mla": (4, 1, 24, 16), "gqa": (6, 2, 16, 8), "mla_many_heads": (20, 1, 24, 16), "gqa_wide_v": (4, 2, 8, 32)}


# The kernel compiles one variant for requests of up to 16 tokens and one for longer ones.
Q_LENS = {"short": [3, 1, 16, 6, 9], "long": [3, 1, 16, 6, 37]}


def setup(fmt: str, tree: bool, dtype: torch.dtype, lens: str = "long"):
    h, hk, d, dv = SHAPES[fmt]
    mla = hk == 1
    cfg = AttentionConfig(h, d, dv, 4, d**-0.5, hk, "mla" if mla else "gqa")
    step = synthetic.make_step(
        [0, 5, 9, 2, 7], Q_LENS[lens], heads=h, head_dim=d, head_dim_v=dv, kv_heads=hk, mla=mla, tree=tree, seed=2
    )
    x = synthetic.rank_inputs(step, DCPLayout(), 4, mla=mla, dtype=dtype, device=DEVICE)
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=dtype, device=DEVICE, backend="reference", fuse_query=False)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    v = x.k[..., :dv] if mla else x.v
    return cfg, x, attn, plan, v


# Every shape: chains in both kernel variants (short, long) and short trees. Long trees, the slowest
# under the interpreter, on one MLA and one GQA shape only: the tree mask does not depend on the shape.
CASES = [(f, t, "short") for f in SHAPES for t in (False, True)] + [(f, False, "long") for f in SHAPES]
CASES += [("mla", True, "long"), ("gqa", True, "long")]


@pytest.mark.parametrize("fmt, tree, lens", CASES)
def test_matches_query_pass_plus_merge(fmt, tree, lens):
    cfg, x, attn, plan, v = setup(fmt, tree, torch.float32, lens)
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    # two context states, one of them empty for token 0 and with NaN there
    g = torch.Generator().manual_seed(0)
    ctx_o = torch.randn(2, *o_q.shape, generator=g).to(DEVICE)
    ctx_lse = torch.randn(2, *lse_q.shape, generator=g).to(DEVICE)
    ctx_lse[0, 0], ctx_o[0, 0] = float("-inf"), float("nan")
    ref_o, ref_lse = merge_states(ctx_o, ctx_lse, extra=(o_q, lse_q), out_dtype=torch.float32)
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    got_o, got_lse = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse, **kw)
    torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-5, atol=1e-5)
    # no context states at all: the bare query pass
    got_o, got_lse = query_merge_triton(x.q, x.k, v, plan, ctx_o[:0], ctx_lse[:0], **kw)
    torch.testing.assert_close(got_o, o_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, lse_q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", ["short", "long"])
def test_context_far_from_the_fresh_scores(lens):
    # Context states 120 above (even tokens) or below (odd) the fresh keys' scores, past float32's exp
    # range: the running max must keep the context's max when later scores are lower, and move up to
    # the scores' when the context is far below, in both kernel variants.
    cfg, x, attn, plan, v = setup("mla", False, torch.float32, lens)
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    g = torch.Generator().manual_seed(4)
    far = 120.0 * (1 - 2 * (torch.arange(lse_q.shape[0]) % 2))[:, None]
    ctx_o = torch.randn(1, *o_q.shape, generator=g).to(DEVICE)
    ctx_lse = (torch.randn(1, *lse_q.shape, generator=g) + far).to(DEVICE)
    ref_o, ref_lse = merge_states(ctx_o.double(), ctx_lse.double(), extra=(o_q.double(), lse_q.double()))
    got_o, got_lse = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse, scale=cfg.scale, out_dtype=torch.float32)
    torch.testing.assert_close(got_o.double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.double(), ref_lse.double(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("fmt", ["mla_many_heads", "gqa_wide_v"])
def test_launch_shape(fmt):
    # A launch shape other than the default: 32 heads per program (mla_many_heads: its 20 heads in one
    # partly masked block), the head and value dims in chunks of 16 (mla: 24 = 16 + a masked half,
    # V 16; gqa_wide_v: 8 in one masked chunk, V 32 = two chunks, so the per-chunk context path).
    cfg, x, attn, plan, v = setup(fmt, True, torch.float32)
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    g = torch.Generator().manual_seed(1)
    ctx_o = torch.randn(1, *o_q.shape, generator=g).to(DEVICE)
    ctx_lse = torch.randn(1, *lse_q.shape, generator=g).to(DEVICE)
    ref_o, ref_lse = merge_states(ctx_o, ctx_lse, extra=(o_q, lse_q), out_dtype=torch.float32)
    got_o, got_lse = query_merge_triton(
        x.q, x.k, v, plan, ctx_o, ctx_lse, scale=cfg.scale, out_dtype=torch.float32, block_h=32, block_d=16, block_v=16
    )
    torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_default_launch_is_wide_only_where_it_fills_the_gpu():
    # From 64 heads per KV head the wide launch (32 heads a program), but not for steps so small that
    # it would have <= 128 programs: there the narrow one's extra programs are faster (session 57).
    from twostage_mla.kernels.query_merge import _wide_launch

    assert not _wide_launch(4096, 1, 32)  # below 64 heads per KV head: always narrow
    assert not _wide_launch(32, 1, 128) and _wide_launch(33, 1, 128)  # 128 vs 132 wide programs
    assert not _wide_launch(64, 1, 64) and _wide_launch(65, 1, 64)
    assert not _wide_launch(16, 2, 128) and _wide_launch(17, 2, 128)  # programs count every KV head


def test_no_context_and_very_negative_scores():
    # Every score near -1e3 and the only context state empty (lse -inf, o NaN): exp() of the
    # scores underflows unless taken relative to their max; the empty state must weigh nothing.
    cfg, x, attn, plan, v = setup("mla", False, torch.float32)
    k = 1.0 + 0.1 * x.k  # every key near (1, .., 1), every query near -30 times that
    q, v = -30.0 + 0.1 * x.q, k[..., : v.shape[-1]]
    o_q, lse_q = attn.backend.query(q, k, v, plan)
    assert lse_q.max() < -100
    ctx_o = torch.full((1, *o_q.shape), float("nan"), device=DEVICE)
    ctx_lse = torch.full((1, *lse_q.shape), float("-inf"), device=DEVICE)
    got_o, got_lse = query_merge_triton(q, k, v, plan, ctx_o, ctx_lse, scale=cfg.scale, out_dtype=torch.float32)
    torch.testing.assert_close(got_o, o_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, lse_q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("lens", list(Q_LENS))
def test_garbage_in_keys_a_token_does_not_see(tree, lens):
    # NaN in the fresh K/V of one token (a sibling branch in the tree, a later token in a chain) must
    # reach only the tokens that see it, with a mask as under capture limits. "long": token 20 of a
    # 37-token request, past the first 16 keys (the long variant's loops).
    cfg, x, attn, plan, v = setup("mla", tree, torch.float32, lens)
    if not tree:  # the causal mask a layer under capture limits passes on chain steps
        w = plan.max_q_len
        plan = replace(plan, query_mask=torch.ones(w, w, dtype=torch.bool, device=DEVICE).tril().expand(5, w, w))
    r, j = (2, 5) if lens == "short" else (4, 20)
    bad = int(plan.query_start_loc[r]) + j
    k = x.k.clone()
    k[bad] = float("nan")
    ctx_o, ctx_lse = torch.randn(1, *x.q.shape[:2], v.shape[-1], device=DEVICE), torch.randn(1, *x.q.shape[:2])
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    clean, _ = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse.to(DEVICE), **kw)
    dirty, _ = query_merge_triton(x.q, k, k[..., : v.shape[-1]], plan, ctx_o, ctx_lse.to(DEVICE), **kw)
    sees = plan.query_mask[plan.token_request, plan.token_offset, j] & (plan.token_request == r)
    assert sees.sum() < (plan.token_request == r).sum()  # some tokens of the request do not see it
    torch.testing.assert_close(dirty[~sees], clean[~sees])
    assert dirty[sees].isnan().all()


def test_nan_query_or_context_state_reaches_the_output():
    # A NaN context lse is not an empty state (-inf), and a NaN query is not a masked score:
    # both must come out as NaN in their (token, head) row, not as a finite answer without them.
    # Only the GPU tells the first apart: its max ignores NaN, Triton's interpreter (numpy) propagates
    # it, so on the CPU this passes with the old test (den > 0) too; the GPU kernel tests guard it.
    cfg, x, attn, plan, v = setup("mla", False, torch.float32)
    ctx_o, ctx_lse = torch.randn(2, *x.q.shape[:2], v.shape[-1], device=DEVICE), torch.randn(2, *x.q.shape[:2])
    ctx_lse = ctx_lse.to(DEVICE)
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    clean, _ = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse, **kw)
    lse_bad, q_bad = ctx_lse.clone(), x.q.clone()
    lse_bad[1, 3, 2] = float("nan")
    q_bad[7, 1, 0] = float("nan")
    for q, lse, row in ((x.q, lse_bad, (3, 2)), (q_bad, ctx_lse, (7, 1))):
        o, out_lse = query_merge_triton(q, x.k, v, plan, ctx_o, lse, **kw)
        assert o[row].isnan().all() and out_lse[row].isnan(), row
        rest = torch.ones(o.shape[:2], dtype=torch.bool, device=DEVICE)
        rest[row] = False
        torch.testing.assert_close(o[rest], clean[rest])


def test_wide_variant_matches(monkeypatch):
    # The 64-bit-offset variant (steps with a tensor of >= 2^31 elements) computes what the default does.
    from twostage_mla.kernels import query_merge

    cfg, x, attn, plan, v = setup("mla", True, torch.float32)
    ctx_o, ctx_lse = torch.randn(2, *x.q.shape[:2], v.shape[-1], device=DEVICE), torch.randn(2, *x.q.shape[:2])
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    want = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse.to(DEVICE), **kw)
    monkeypatch.setattr(query_merge, "wide_offsets", lambda *t: True)
    got = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse.to(DEVICE), **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_output_and_bad_shapes():
    cfg, x, attn, plan, v = setup("mla", False, torch.bfloat16)
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    got_o, _ = query_merge_triton(x.q, x.k, v, plan, o_q[None], lse_q[None], scale=cfg.scale, out_dtype=torch.bfloat16)
    assert got_o.dtype == torch.bfloat16
    ref, _ = merge_states(o_q[None], lse_q[None], extra=(o_q, lse_q))
    torch.testing.assert_close(got_o.float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"ctx_o: \(K, T, H, Dv\)"):
        query_merge_triton(x.q, x.k, v, plan, o_q[None, :3], lse_q[None, :3], scale=cfg.scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"max_q_len >= 37 \(the plan's longest request\), got 16"):
        query_merge_triton(x.q, x.k, v, plan, o_q[None], lse_q[None], scale=cfg.scale, out_dtype=torch.float32,
                           max_q_len=16)  # fmt: skip
    # A launch shape the kernel cannot take: refused by name, never run as the default in its place.
    for kw, msg in (
        (dict(block_h=0), "block_h a power of two >= 16, got 0"),
        (dict(block_d=24), "block_d a power of two >= 16, got 24"),
        (dict(block_v=8), "block_v a power of two >= 16, got 8"),
        (dict(num_warps=3), "num_warps a power of two >= 1, got 3"),
        (dict(v_stages=0), "v_stages >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            query_merge_triton(x.q, x.k, v, plan, o_q[None], lse_q[None], scale=cfg.scale, out_dtype=torch.float32,
                               **kw)  # fmt: skip
    # Tokens other than the plan's (out-of-bounds reads of its indices), heads not a multiple of the
    # KV heads (heads left unwritten), q and k of other head dims: refused, by shape.
    t = plan.num_tokens
    bad = (
        (x.q[:-1], x.k[:-1], v[:-1]),
        (x.q[:, :-1], x.k.expand(-1, 2, -1), v.expand(-1, 2, -1)),  # 3 heads over 2 KV heads
        (x.q, x.k[..., :-1], v),
    )
    for q_, k_, v_ in bad:
        with pytest.raises(ValueError, match=rf"with T = plan.num_tokens = {t} and H a multiple of H_kv"):
            query_merge_triton(q_, k_, v_, plan, o_q[None], lse_q[None], scale=cfg.scale, out_dtype=torch.float32)


def test_a_wider_mask_and_bad_masks():
    # Plans of a layer under capture limits carry a fixed mask wider than the step's requests
    # (zero past them): the kernel and the dense query pass read only each request's square.
    cfg, x, attn, plan, v = setup("gqa", True, torch.float32, "short")
    wide = torch.ones(6, 20, 20, dtype=torch.bool, device=DEVICE)  # True outside the step's square
    wide[:5, :16, :16] = plan.query_mask
    wider = replace(plan, query_mask=wide[:5])
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    got = attn.backend.query(x.q, x.k, v, wider)
    torch.testing.assert_close(got, (o_q, lse_q))
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    got = query_merge_triton(x.q, x.k, v, wider, o_q[None][:0], lse_q[None][:0], **kw)
    torch.testing.assert_close(got, (o_q, lse_q), rtol=1e-5, atol=1e-5)
    m = plan.query_mask
    for bad in (m[:, :8], m[:, :, :8], m[:4], m.transpose(1, 2)):
        with pytest.raises(ValueError, match=r"expected plan.query_mask: \(B, W, W\) = \(>= 5, >= 16, >= 16\)"):
            query_merge_triton(x.q, x.k, v, replace(plan, query_mask=bad), o_q[None], lse_q[None], **kw)


def test_falls_back_to_fewer_stages_where_shared_memory_is_short(monkeypatch):
    # The pipelining's stages were measured on H200s; a GPU with less shared memory makes Triton
    # refuse the launch (OutOfResources), and the kernel runs again without pipelining.
    from triton.runtime.errors import OutOfResources

    import twostage_mla.kernels.query_merge as qm

    cfg, x, attn, plan, v = setup("mla", False, torch.float32, "short")
    o_q, lse_q = attn.backend.query(x.q, x.k, v, plan)
    calls, launch = [], qm._launch

    def short_of_shared_memory(grid, args, meta, *, v_stages, num_stages):
        calls.append((v_stages, num_stages))
        if num_stages > 1:
            raise OutOfResources(300_000, 101_376, "shared memory")
        launch(grid, args, meta, v_stages=v_stages, num_stages=num_stages)

    monkeypatch.setattr(qm, "_launch", short_of_shared_memory)
    kw = dict(scale=cfg.scale, out_dtype=torch.float32)
    got = query_merge_triton(x.q, x.k, v, plan, o_q[None][:0], lse_q[None][:0], **kw)
    torch.testing.assert_close(got, (o_q, lse_q), rtol=1e-5, atol=1e-5)
    assert calls == [(2, 4), (1, 1)]
    with pytest.raises(OutOfResources):  # stages the caller chose: no other launch in their place
        query_merge_triton(x.q, x.k, v, plan, o_q[None][:0], lse_q[None][:0], v_stages=2, **kw)


def test_fuse_query_needs_cuda():
    if DEVICE == "cuda":
        pytest.skip("CUDA present")
    cfg = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.2)
    want = r"fuse_query None \(the default: fused where it runs\) or False on cpu with torch.float32, got True"
    with pytest.raises(ValueError, match=want + ": the fused kernel needs CUDA"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, fuse_query=True)


def _layer_fused(rank: int, world: int, combine: str, tree: bool) -> float:
    cfg = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.2)
    layout = DCPLayout(world, rank, 2)
    step = synthetic.make_step([0, 3, 37], [2, 5, 3], heads=2 * world, head_dim=24, head_dim_v=16, tree=tree, seed=5)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu", fill=float("nan"))
    attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, combine=combine, dtype=torch.float32)
    attn.query_merge = query_merge_triton  # what fuse_query=True picks on CUDA
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    out = attn(x.q, x.k, None, x.k_cache, None, plan)
    ref, _ = synthetic.oracle(step, cfg.scale, slice(2 * rank, 2 * rank + 2))
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU interpreter path; GPU tests cover CUDA")
def test_layer_with_fused_query():
    for combine, tree in (("a2a", True), ("ag_rs", False)):
        assert max(run_ranks(2, _layer_fused, combine, tree)) < 1e-5
