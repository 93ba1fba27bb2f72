import pytest
import torch

from twostage_mla.state import merge_state, merge_state_, merge_states


def state(s: torch.Tensor, v: torch.Tensor):
    """Exact state of scores s (T, H, K) over values v (K, Dv)."""
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def test_merge_equals_softmax_over_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 3, 10, generator=g, dtype=torch.float64) * 3
    v = torch.randn(10, 7, generator=g, dtype=torch.float64)
    o, lse = state(s, v)
    oa, la = state(s[..., :4], v[:4])
    ob, lb = state(s[..., 4:], v[4:])
    om, lm = merge_state(oa, la, ob, lb)
    torch.testing.assert_close(om, o.to(om.dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lm.double(), lse, rtol=1e-6, atol=1e-6)


def test_merge_many_is_order_independent_and_associative():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(4, 6, 2, 5, generator=g)
    lse = torch.randn(4, 6, 2, generator=g) * 4
    ref_o, ref_l = merge_states(o, lse)
    perm = torch.tensor([2, 0, 3, 1])
    po, pl = merge_states(o[perm], lse[perm])
    torch.testing.assert_close(po, ref_o)
    torch.testing.assert_close(pl, ref_l)
    left = merge_states(o[:2], lse[:2])
    right = merge_states(o[2:], lse[2:])
    ao, al = merge_state(left[0], left[1], right[0], right[1])
    torch.testing.assert_close(ao, ref_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(al, ref_l)


def test_empty_states_merge_without_nan():
    o = torch.randn(3, 4, 2, 8)
    lse = torch.randn(3, 4, 2)
    lse[:, 0] = float("-inf")  # token 0: every state empty
    lse[1, 1] = float("-inf")  # token 1: one state empty
    o[1, 1] = float("nan")  # an empty state's o may be garbage
    om, lm = merge_states(o, lse)
    assert not om.isnan().any()
    assert torch.equal(om[0], torch.zeros_like(om[0]))
    assert torch.isneginf(lm[0]).all()
    keep = torch.tensor([0, 2])
    ro, rl = merge_states(o[keep, 1:2], lse[keep, 1:2])
    torch.testing.assert_close(om[1:2], ro)
    torch.testing.assert_close(lm[1:2], rl)


def test_merge_with_empty_is_identity_in_place():
    o = torch.randn(4, 2, 8)
    lse = torch.randn(4, 2)
    oa, la = o.clone(), lse.clone()
    merge_state_(oa, la, torch.zeros_like(o), torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(oa, o)
    torch.testing.assert_close(la, lse)


def test_bf16_merge_accumulates_in_float32():
    o = torch.randn(2, 64, 4, 16).bfloat16()
    lse = torch.randn(2, 64, 4)
    om, lm = merge_states(o, lse)
    assert om.dtype == torch.bfloat16 and lm.dtype == torch.float32
    ref, _ = merge_states(o.double(), lse.double())
    assert (om.double() - ref).abs().max() < 2e-2


def test_shape_errors_name_arguments():
    with pytest.raises(ValueError, match=r"lse: \(K, T, H\)"):
        merge_states(torch.randn(2, 3, 4, 5), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"o: \(K, T, H, Dv\)"):
        merge_states(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="o_a"):
        merge_state(torch.randn(3, 4, 5), torch.randn(3, 4), torch.randn(3, 4, 6), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"expected lse_a float32 \(written in place\), got torch.float16"):
        merge_state_(torch.randn(3, 4, 5), torch.randn(3, 4).half(), torch.randn(3, 4, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"expected extra = \(o \(T, H, Dv\) = \(3, 4, 5\), lse \(T, H\) = \(3, 4\)\)"):
        merge_states(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), extra=(torch.randn(3, 4, 6), torch.randn(3, 4)))


def test_dtype_and_device_errors_name_arguments():
    o, lse = torch.randn(3, 4, 5), torch.randn(3, 4)
    # An integer o would merge in integer maths (0 for 0.5), a complex one would lose its imaginary part.
    with pytest.raises(ValueError, match="expected o_a to be a floating-point tensor, got a torch.int64 tensor"):
        merge_state(torch.ones(3, 4, 5, dtype=torch.long), lse, o, lse)
    with pytest.raises(ValueError, match="expected o to be a floating-point tensor, got a torch.complex64"):
        merge_states(torch.randn(2, 3, 4, 5, dtype=torch.cfloat), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="expected lse_b to be a floating-point tensor, got NoneType"):
        merge_state_(o, lse, o, None)
    with pytest.raises(ValueError, match=r"expected o, lse on one device, got \['cpu', 'meta'\]"):
        merge_states(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, device="meta"))
    with pytest.raises(ValueError, match="expected out_dtype to be None or a floating torch.dtype, got 'float16'"):
        merge_state(o, lse, o, lse, out_dtype="float16")
    with pytest.raises(ValueError, match=r"expected extra = \(o \(T, H, Dv\), lse \(T, H\)\), got Tensor"):
        merge_states(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), extra=o)


def test_states_far_apart_merge_by_their_largest_lse():
    # lse 150 apart, past float32's exp range (~88), the larger in any position: the merge must shift
    # by the largest lse, not by the first state's (exp(150) is inf in float32).
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 3, 12, generator=g, dtype=torch.float64)
    s[..., 4:8] += 150.0
    v = torch.randn(12, 7, generator=g, dtype=torch.float64)
    o, lse = state(s, v)
    parts = [state(s[..., i : i + 4], v[i : i + 4]) for i in (0, 4, 8)]
    for a, b in ((parts[0], parts[1]), (parts[1], parts[0])):
        om, lm = merge_state(a[0].float(), a[1].float(), b[0].float(), b[1].float())
        two = state(s[..., :8], v[:8])
        torch.testing.assert_close(om.double(), two[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lm.double(), two[1], rtol=1e-6, atol=1e-4)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        om, lm = merge_states(torch.stack([parts[i][0] for i in order]).float(),
                              torch.stack([parts[i][1] for i in order]).float())  # fmt: skip
        torch.testing.assert_close(om.double(), o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lm.double(), lse, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("big", [1e2, 1e4, 1e5])
def test_merge_is_exact_at_large_lse(big):
    # The weights must be normalised: exp(lse_k - logsumexp) alone carries logsumexp's rounding
    # (~|lse| * 2^-24) into o: 2.5e-4 relative at lse = 1e4 before the fix.
    o = torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)
    lse = torch.tensor([big, big + 0.3]).view(2, 1, 1)
    w = torch.softmax(lse.double(), dim=0)
    ref = (w[:, :, :, None] * o.double()).sum(0)
    got, _ = merge_states(o, lse)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)


def test_nan_state_is_not_taken_for_empty():
    # An empty state is lse = -inf; a NaN lse (a NaN query upstream, say) must reach the output, not
    # weigh 0 and leave a finite answer that hides it.
    o, lse = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2)
    lse[0, 1, 0] = float("nan")
    om, lm = merge_states(o, lse)
    assert om[1, 0].isnan().all() and lm[1, 0].isnan()
    bad = torch.zeros(3, 2, dtype=torch.bool)
    bad[1, 0] = True
    assert torch.isfinite(om[~bad]).all() and torch.isfinite(lm[~bad]).all()


def test_in_place_merge_updates_both_o_and_lse():
    oa, la, ob, lb = torch.randn(3, 2, 4), torch.randn(3, 2), torch.randn(3, 2, 4), torch.randn(3, 2)
    ref_o, ref_lse = merge_state(oa, la, ob, lb)
    merge_state_(oa, la, ob, lb)
    torch.testing.assert_close(oa, ref_o)
    torch.testing.assert_close(la, ref_lse)


def test_output_dtype_follows_o_unless_given():
    for dtype in (torch.float64, torch.bfloat16):
        o, lse = merge_state(torch.randn(3, 2, 4).to(dtype), torch.randn(3, 2), torch.randn(3, 2, 4).to(dtype),
                             torch.randn(3, 2))  # fmt: skip
        assert o.dtype == dtype and lse.dtype == torch.float32
    o, _ = merge_states(torch.randn(2, 3, 4, 5).bfloat16(), torch.randn(2, 3, 4), out_dtype=torch.float32)
    assert o.dtype == torch.float32


def test_extra_is_one_more_state():
    o, lse, eo, el = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), torch.randn(3, 4, 5), torch.randn(3, 4)
    got = merge_states(o, lse, extra=(eo, el))
    torch.testing.assert_close(got, merge_states(torch.cat([o, eo[None]]), torch.cat([lse, el[None]])))
    torch.testing.assert_close(merge_states(o[:0], lse[:0], extra=(eo, el)), (eo, el))  # K = 0: the extra alone
