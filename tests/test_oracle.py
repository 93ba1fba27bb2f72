import pytest
import torch

from twostage_mla.oracle import oracle_attention


def test_oracle_matches_sdpa_on_causal_suffix():
    """Request with context C and Q queries == bottom-right causal attention."""
    g = torch.Generator().manual_seed(0)
    c, nq, h, d = 7, 5, 4, 16
    q = torch.randn(nq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(c + nq, 2, d, generator=g, dtype=torch.float64)
    v = torch.randn(c + nq, 2, 8, generator=g, dtype=torch.float64)
    o, lse = oracle_attention(q, k, v, torch.tensor([0, nq]), torch.tensor([c + nq]), 0.3)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.arange(c + nq)[None, :] <= c + torch.arange(nq)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(o, ref)
    s = torch.einsum("thd,nhd->thn", q, kk) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s.masked_fill(~mask[:, None], float("-inf")), -1))


def test_oracle_tree_mask_and_batches():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 2, 8, generator=g)
    k = torch.randn(1 + 6, 1, 8, generator=g)
    # request 0: C=0, Q=1; request 1: C=3, Q=3 with tree 0 <- 1, 0 <- 2
    qsl, sl = torch.tensor([0, 1, 4]), torch.tensor([1, 6])
    o, _ = oracle_attention(q, k, k, qsl, sl, 0.5, parents=torch.tensor([-1, -1, 0, 0]))
    torch.testing.assert_close(o[0].float(), k[0, 0].expand(2, 8))  # one key: its value
    # token 2 of request 1 (index 3 in q) sees context 1..3 and tree tokens 0, 2 -> rows 1,2,3,4,6
    rows = torch.tensor([1, 2, 3, 4, 6])
    s = torch.einsum("hd,nd->hn", q[3].double(), k[rows, 0].double()) * 0.5
    torch.testing.assert_close(o[3], torch.softmax(s, -1) @ k[rows, 0].double())
    # two roots: token 1 sees the context and itself, not token 0 (the first new key is no context)
    q, k = q[:2, :1].double(), k[:4].double()
    o, _ = oracle_attention(q, k, k, torch.tensor([0, 2]), torch.tensor([4]), 0.5, parents=torch.tensor([-1, -1]))
    rows = torch.tensor([0, 1, 3])
    torch.testing.assert_close(o[1, 0], torch.softmax(q[1, 0] @ k[rows, 0].T * 0.5, -1) @ k[rows, 0])


def test_oracle_empty_batch_with_parents():
    o, lse = oracle_attention(
        torch.randn(0, 2, 8), torch.randn(0, 1, 8), torch.randn(0, 1, 6), torch.tensor([0]),
        torch.tensor([], dtype=torch.int64), 0.3, parents=torch.tensor([], dtype=torch.int64),
    )  # fmt: skip
    assert o.shape == (0, 2, 6) and lse.shape == (0, 2)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.randn(5, 2, 8)), r"expected q: \(T = query_start_loc\[-1\] = 4"),
        (dict(q=torch.randn(4, 3, 8), k=torch.randn(7, 2, 8)), "H a multiple of H_kv = 2"),
        (dict(k=torch.randn(8, 1, 8)), r"expected k: \(S = seq_lens.sum\(\) = 7"),
        (dict(v=torch.randn(7, 2, 6)), r"v: \(S, H_kv, Dv\)"),
        (dict(seq_lens=torch.tensor([1, 2])), r"expected q_len <= seq_len .* seq_lens\[1\] = 2"),
        (dict(query_start_loc=torch.tensor([0, 4])), r"expected query_start_loc.shape == \(B\+1,\) = \(3,\)"),
        (dict(parents=torch.tensor([-1, 0])), r"expected parents.shape == \(T,\) = \(4,\)"),
        (dict(parents=torch.tensor([-1, -1, 2, 0])), "parents before children"),
        (dict(seq_lens=[1, 6]), "expected seq_lens to be a 1-D signed integer tensor"),
        # the layer refuses these scales too: a NaN one would give a NaN oracle, 0 or -1 a wrong one
        (dict(scale=float("nan")), "expected scale to be a finite real number > 0"),
        (dict(scale=-1.0), "expected scale to be a finite real number > 0"),
        (dict(scale=None), "expected scale to be a finite real number > 0"),
        (dict(q=torch.randn(4, 2, 8, dtype=torch.cfloat)), "expected q: a 3-D floating-point tensor with values, got "),
        (dict(k=torch.randn(7, 1, 8, device="meta")), "expected k: a 3-D floating-point tensor .* on meta"),
    ],
)
def test_oracle_refuses_inputs_that_disagree(change, match):
    args = dict(
        q=torch.randn(4, 2, 8), k=torch.randn(7, 1, 8), v=torch.randn(7, 1, 6), query_start_loc=torch.tensor([0, 1, 4]),
        seq_lens=torch.tensor([1, 6]), scale=0.5, parents=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        oracle_attention(**{**args, **change})


def test_a_request_with_no_queries_is_skipped_with_its_keys():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(12, 1, 8, generator=g)
    both, lse = oracle_attention(q, k, k[..., :6], torch.tensor([0, 0, 3]), torch.tensor([5, 7]), 0.4)
    alone, lse1 = oracle_attention(q, k[5:], k[5:, :, :6], torch.tensor([0, 3]), torch.tensor([7]), 0.4)
    torch.testing.assert_close(both, alone)
    torch.testing.assert_close(lse, lse1)
