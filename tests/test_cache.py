"""build_shard: every position lands on exactly one rank, where the layout and its block table say."""

import pytest
import torch

from twostage_mla import DCPLayout, build_shard
from twostage_mla.layout import local_index, local_pages, owner


@pytest.mark.parametrize("n,il,page", [(1, 1, 4), (2, 1, 1), (3, 2, 4), (4, 4, 16)])
def test_each_position_is_stored_once_at_its_owner(n, il, page):
    sl = torch.tensor([0, 1, 7, 29])  # an empty request, one shorter than N * I, longer ones
    kv = torch.randn(int(sl.sum()), 1, 6, dtype=torch.float64)
    start = (torch.cumsum(sl, 0) - sl).tolist()
    stored = 0
    for r in range(n):
        layout = DCPLayout(world_size=n, rank=r, interleave=il)
        cache, table = build_shard(kv, sl, layout, page, generator=torch.Generator().manual_seed(r), fill=float("nan"))
        assert cache.shape[1:] == (page, 1, 6) and table.dtype == torch.int32
        mine = 0
        for b, s in enumerate(sl.tolist()):
            for p in range(s):
                if owner(p, n, il) == r:
                    li = local_index(p, n, il)
                    assert torch.equal(cache[table[b, li // page], li % page], kv[start[b] + p]), (r, b, p)
                    mine += 1
        assert int((~cache.isnan()).all(dim=-1).sum()) == mine  # nothing else written
        stored += mine
    assert stored == kv.shape[0]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kv=torch.randn(5, 1, 6)), r"expected kv: \(S = seq_lens.sum\(\) = 8, H_kv, D\), got \(5, 1, 6\)"),
        (dict(kv=torch.randn(8, 6)), r"expected kv: \(S = seq_lens.sum\(\) = 8"),
        (dict(seq_lens=[3, 5]), "expected seq_lens to be a 1-D signed integer tensor, got list"),
        (dict(seq_lens=torch.tensor([9, -1])), r"expected seq_lens >= 0, got \[9, -1\]"),
        (dict(page_size=0), "expected page_size to be a positive multiple of interleave = 2, got 0"),
        (dict(page_size=3), "expected page_size to be a positive multiple of interleave = 2, got 3"),
        (dict(layout=(2, 0, 2)), "expected layout to be a DCPLayout, got tuple"),
        (dict(extra_pages=-1), "expected extra_pages to be an int >= 0, got -1"),
        (dict(kv=torch.ones(8, 1, 6, dtype=torch.long)), "expected kv: a floating-point tensor with values, got "),
        (dict(generator=0), "expected generator to be a CPU torch.Generator or None, got 0"),
        (dict(fill="nan"), "expected fill to be a real number or None, got 'nan'"),
    ],
)
def test_bad_arguments_are_named(change, match):
    args = dict(kv=torch.randn(8, 1, 6), seq_lens=torch.tensor([3, 5]), layout=DCPLayout(2, 0, 2), page_size=4)
    with pytest.raises(ValueError, match=match):
        build_shard(**{**args, **change})


@pytest.mark.parametrize("extra", [0, 3])
def test_build_shard_adds_extra_pages(extra):
    sl = torch.tensor([5, 17])
    cache, table = build_shard(torch.randn(22, 1, 6), sl, DCPLayout(2, 1, 2), 4, extra_pages=extra)
    used = sum(local_pages(s, 2, 2, 1, 4) for s in sl.tolist())
    assert cache.shape[0] == used + extra and int((table >= 0).sum()) == used
