"""The Triton merge kernel against the torch maths (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_ranks
from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, synthetic
from twostage_mla.state import merge_states

pytest.importorskip("triton")
from twostage_mla.kernels import merge  # noqa: E402
from twostage_mla.kernels.merge import merge_states_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def states(k: int, t: int, h: int, dv: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(k * 100 + dv)
    o = torch.randn(k, t, h, dv, generator=g).to(dtype)
    lse = torch.randn(k, t, h, generator=g) * 5
    lse[:, 0] = float("-inf")  # every state empty
    lse[0, 1] = float("-inf")
    o[0, 1] = float("nan")  # garbage under an empty state
    return o.to(DEVICE), lse.to(DEVICE)


@pytest.mark.parametrize("k,dv,dtype", [(1, 16, torch.float32), (3, 24, torch.bfloat16), (4, 512, torch.float16)])
@pytest.mark.parametrize("with_extra", [False, True])
def test_matches_torch(k, dv, dtype, with_extra):
    o, lse = states(k, 6, 3, dv, dtype)
    extra = None
    if with_extra:
        eo, el = states(1, 6, 3, dv, torch.float32)
        extra = (eo[0], el[0])
    got_o, got_lse = merge_states_triton(o, lse, extra=extra, out_dtype=torch.float32)
    ref_o, ref_lse = merge_states(o, lse, extra=extra, out_dtype=torch.float32)
    assert not got_o.isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse)
    assert torch.equal(got_o[0], torch.zeros_like(got_o[0])) and torch.isneginf(got_lse[0]).all()


def test_strided_input_and_out_dtype():
    """The a2a receive buffer is a strided view; the output is cast once."""
    o, lse = states(2, 5, 4, 8, torch.bfloat16)
    wide = torch.zeros(2, 5, 4, 12, dtype=torch.bfloat16, device=DEVICE)
    wide[..., :8] = o
    got_o, got_lse = merge_states_triton(wide[..., :8], lse)
    ref_o, ref_lse = merge_states(o, lse)
    assert got_o.dtype == torch.bfloat16
    torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_lse, ref_lse)


def test_bad_shapes():
    o, lse = states(2, 5, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"lse.shape == \(K, T, H\) = \(2, 5, 4\)"):
        merge_states_triton(o, lse[:, :3])
    with pytest.raises(ValueError, match=r"extra = \(o \(T, H, Dv\) = \(5, 4, 8\)"):
        merge_states_triton(o, lse, extra=(o[0, :, :2], lse[0]))


def _layer_with_triton_merge(rank: int, world: int, combine: str) -> float:
    cfg = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.2)
    layout = DCPLayout(world, rank, 2)
    step = synthetic.make_step([0, 3, 37], [2, 5, 3], heads=2 * world, head_dim=24, head_dim_v=16, seed=5)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu")
    attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, combine=combine, dtype=torch.float32)
    attn.merge = merge_states_triton  # what select_merge picks on CUDA
    out = attn(x.q, x.k, None, x.k_cache, None, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
    ref, _ = synthetic.oracle(step, cfg.scale, slice(2 * rank, 2 * rank + 2))
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU interpreter path; GPU tests cover CUDA")
def test_layer_with_triton_merge():
    for combine in ("a2a", "ag_rs"):
        assert max(run_ranks(2, _layer_with_triton_merge, combine)) < 1e-5


def test_no_states_is_the_empty_state():
    # K = 0 and no extra: what merge_states gives, (0, -inf), not an index error.
    o, lse = torch.randn(0, 3, 4, 8, device=DEVICE), torch.randn(0, 3, 4, device=DEVICE)
    got_o, got_lse = merge_states_triton(o, lse, out_dtype=torch.float32)
    ref_o, ref_lse = merge_states(o, lse)
    torch.testing.assert_close(got_o, ref_o.float())
    assert torch.equal(got_lse, ref_lse) and got_lse.isneginf().all()
    # ... and with an extra state: that state
    eo, el = torch.randn(3, 4, 8, device=DEVICE), torch.randn(3, 4, device=DEVICE)
    torch.testing.assert_close(merge_states_triton(o, lse, extra=(eo, el)), (eo, el))


def test_no_overflow_near_the_dtype_max():
    # Normalised weights: K states of o near bf16's max merge to o, not inf (acc / total would overflow).
    o, lse = torch.full((2, 1, 1, 4), 3e38, dtype=torch.bfloat16, device=DEVICE), torch.zeros(2, 1, 1, device=DEVICE)
    got, _ = merge_states_triton(o, lse)
    assert torch.isfinite(got).all() and torch.equal(got.cpu(), merge_states(o.cpu(), lse.cpu())[0])


def test_extra_state_far_above_the_others():
    # The extra state's lse 150 above the K states' (past float32's exp range): the shift is the max
    # over all K + 1 states, the extra one included. Token 0: every K state empty, the extra not.
    o, lse = states(3, 5, 2, 16, torch.float32)
    eo, el = states(1, 5, 2, 16, torch.float32)
    el = el[0] + 150.0
    el[0] = 1.0 + 150.0
    lses = torch.cat([lse, el[None]]).double().cpu()
    w = torch.softmax(lses, dim=0)[..., None]
    ref_o = (w * torch.cat([o, eo]).double().cpu().nan_to_num()).sum(0)
    got_o, got_lse = merge_states_triton(o, lse, extra=(eo[0], el), out_dtype=torch.float32)
    torch.testing.assert_close(got_o.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.cpu().double(), torch.logsumexp(lses, dim=0), rtol=1e-6, atol=1e-4)


def test_nan_state_is_not_taken_for_empty():
    # As merge_states: lse = -inf is empty (its o, even NaN, is left out); a NaN lse reaches the output.
    o, lse = torch.randn(3, 4, 2, 16, device=DEVICE), torch.randn(3, 4, 2, device=DEVICE)
    lse[0, 1, 0] = float("nan")
    lse[2, 2, 1], o[2, 2, 1] = float("-inf"), float("nan")
    for extra in (None, (torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 2, device=DEVICE))):
        got_o, got_lse = merge_states_triton(o, lse, out_dtype=torch.float32, extra=extra)
        ref_o, ref_lse = merge_states(o, lse, out_dtype=torch.float32, extra=extra)
        assert got_o[1, 0].isnan().all() and got_lse[1, 0].isnan()
        torch.testing.assert_close(got_o, ref_o, equal_nan=True)
        torch.testing.assert_close(got_lse, ref_lse, equal_nan=True)


def test_wide_offsets_decision():
    # Triton's 32-bit offsets wrap at 2^31 elements: any tensor that reaches it takes the 64-bit variant.
    big = torch.empty(2**31, device="meta")
    assert not merge.wide_offsets(torch.empty(4, 8, device="meta"), big[: 2**30])
    assert merge.wide_offsets(torch.empty(4, 8, device="meta"), big)
    assert merge.wide_offsets(big[:16].as_strided((3, 16), (2**30, 1)))  # by strides, not by size


def test_wide_variant_matches(monkeypatch):
    # The 64-bit variant (compiled only for such steps) computes what the 32-bit one does.
    o, lse = torch.randn(3, 5, 4, 24, device=DEVICE), torch.randn(3, 5, 4, device=DEVICE)
    lse[1, 2, 3] = float("-inf")
    extra = (torch.randn(5, 4, 24, device=DEVICE), torch.randn(5, 4, device=DEVICE))
    want = merge_states_triton(o, lse, out_dtype=torch.float32, extra=extra)
    monkeypatch.setattr(merge, "wide_offsets", lambda *t: True)
    got = merge_states_triton(o, lse, out_dtype=torch.float32, extra=extra)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(DEVICE == "cpu", reason="a 4.8 GB buffer: on a GPU only")
def test_states_past_two_to_the_31_elements():
    s = 1_200_000_000  # the third state starts at 2.4e9 elements: 32-bit offsets would wrap
    o = torch.empty(2 * s + 16, dtype=torch.bfloat16, device=DEVICE).as_strided((3, 1, 1, 16), (s, 16, 16, 1))
    for k in range(3):
        o[k] = k + 1.0
    got, _ = merge_states_triton(o, torch.zeros(3, 1, 1, device=DEVICE), out_dtype=torch.float32)
    assert torch.equal(got, torch.full_like(got, 2.0))
