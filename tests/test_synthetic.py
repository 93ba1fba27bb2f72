"""The test-data builder: what it promises the other tests (a bug here could hide one elsewhere)."""

import pytest
import torch

from twostage_mla import DCPLayout, synthetic


@pytest.mark.parametrize("mla", [True, False])
def test_rank_inputs_fill_every_slot_the_rank_does_not_own(mla):
    # The NaN fill is what makes the layer tests fail on a read of an unwritten slot: it must reach
    # every cache, and leave exactly the rank's own positions finite.
    step = synthetic.make_step([5, 9], [2, 3], heads=4, head_dim=16, head_dim_v=8, kv_heads=1, mla=mla, seed=2)
    nan = float("nan")
    x = synthetic.rank_inputs(step, DCPLayout(2, 0, 2), 4, mla=mla, dtype=torch.float32, device="cpu", fill=nan)
    mine = sum(int(n) // 4 * 2 + min(int(n) % 4, 2) for n in step.seq_lens)  # N = 2, I = 2: rank 0's positions
    for cache in [x.k_cache] if mla else [x.k_cache, x.v_cache]:
        assert int((~cache.isnan()).all(dim=-1).sum()) == mine and cache.isnan().any()


def test_random_trees_hold_chain_links_branches_and_roots():
    step = synthetic.make_step([3] * 8, [8] * 8, heads=1, head_dim=8, head_dim_v=8, tree=True, seed=0)
    offsets = torch.arange(8).repeat(8)
    p, later = step.parents, offsets > 0
    assert (p[later] == offsets[later] - 1).any()  # the previous token: a chain link
    assert (p[later] == -1).any()  # another root
    assert ((p[later] >= 0) & (p[later] < offsets[later] - 1)).any()  # an earlier token: a branch
