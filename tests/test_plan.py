import pytest
import torch

from twostage_mla.layout import DCPLayout
from twostage_mla.plan import expanded_context_plan, plan_step

I32 = dict(dtype=torch.int32)


LAYOUT = DCPLayout(2, 1, 2)


def make(qsl, sl, pages=8, page_size=4, layout=LAYOUT, **kw):
    bt = torch.arange(len(sl) * pages, **I32).view(len(sl), pages)
    return plan_step(torch.tensor(qsl, **I32), torch.tensor(sl, **I32), bt, page_size=page_size, layout=layout, **kw)


def test_worked_example():
    # N=2, r=1, I=2; request 0: C=9, Q=3; request 1: C=2, Q=1 (rank 1 holds none of it)
    p = make([0, 3, 4], [12, 3])
    assert (p.num_tokens, p.batch_size, p.max_q_len) == (4, 2, 3)
    assert p.context_lens.tolist() == [9, 2]
    assert p.local_context_lens.tolist() == [4, 0]  # positions 2 3 6 7 | none
    assert p.max_local_context_len == 4 and p.max_context_len == 9
    assert p.token_request.tolist() == [0, 0, 0, 1]
    assert p.token_offset.tolist() == [0, 1, 2, 0]
    assert p.query_mask is None
    # new tokens at positions 9 10 11 | 2: rank 1 owns 10, 11 (local 4, 5: page 1 of row 0)
    # and 2 (local 0: page 8, the first of row 1)
    assert p.new_token_slots().tolist() == [-1, 1 * 4 + 0, 1 * 4 + 1, 8 * 4 + 0]
    assert p.write_rows.tolist() == [1, 2, 3] and p.write_slots.tolist() == [4, 5, 32]
    cache = torch.zeros(16, 4, 1, 3)
    new = torch.arange(12.0).view(4, 1, 3) + 1
    p.write_new_tokens(cache, new)
    flat = cache.view(-1, 1, 3)
    assert torch.equal(flat[[4, 5, 32]], new[1:]) and flat.abs().sum() == new[1:].sum()


def test_tree_mask_is_ancestor_or_self():
    #   0
    #  / \
    # 1   2
    #     |
    #     3
    p = make([0, 4], [10], parents=torch.tensor([-1, 0, 0, 2]))
    assert p.query_mask[0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 0, 1, 1],
    ]


def test_zero_query_request_and_empty_batch():
    p = make([0, 0, 2], [5, 2])
    assert p.token_request.tolist() == [1, 1]
    e = plan_step(
        torch.zeros(1, **I32), torch.zeros(0, **I32), torch.zeros(0, 1, **I32), page_size=4, layout=DCPLayout()
    )
    assert e.num_tokens == 0 and e.max_q_len == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(qsl=[0, 3], sl=[2]), r"q_len <= seq_len .* got q_len 3 > seq_lens\[0\] = 2"),
        (dict(qsl=[0, 1], sl=[-1]), r"seq_lens >= 0, got seq_lens\[0\] = -1"),
        (dict(qsl=[0, 2, 1], sl=[4, 4]), r"query_start_loc non-decreasing"),
        (dict(qsl=[1, 2], sl=[4]), r"query_start_loc\[0\] == 0"),
        (dict(qsl=[0, 1, 2], sl=[4]), r"query_start_loc.shape == \(B\+1,\) = \(2,\)"),
        (
            dict(qsl=[0, 1], sl=[100], pages=2),
            r"at least 13 pages per request on every rank, got 2: as wide as rank 0 needs \(request 0 keeps "
            r"local_len\(seq_len=100\) = 50 tokens on rank 0.*pad the entries this rank does not use with -1",
        ),
        # rank 1 (this plan) needs 2 pages of 1 token, rank 0 needs 3: refused on every rank alike
        (
            dict(qsl=[0, 1], sl=[5], pages=2, page_size=1, layout=DCPLayout(2, 1, 1)),
            r"at least 3 pages per request on every rank, got 2: as wide as rank 0 needs",
        ),
        (dict(qsl=[0, 1], sl=[4], page_size=3), r"page_size to be a positive multiple of interleave = 2, got 3"),
        (dict(qsl=[0, 2], sl=[4], parents=torch.tensor([-1, 1])), r"parents\[t\] == -1 or 0 <= parents\[t\] <"),
        (dict(qsl=[0, 2], sl=[4], parents=torch.tensor([-1, -2])), r"parents\[t\] == -1 or 0 <= parents\[t\] <"),
        (dict(qsl=[0, 2], sl=[4], parents=torch.tensor([-1])), r"parents.shape == \(T,\) = \(2,\)"),
        (dict(qsl=[0, 1], sl=[4], page_size=0), r"page_size to be a positive multiple of interleave = 2, got 0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_bad_types():
    with pytest.raises(ValueError, match="seq_lens to be a 1-D signed integer tensor, got torch.float32"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2.0]), torch.zeros(1, 1, **I32), page_size=4, layout=DCPLayout())
    with pytest.raises(ValueError, match="block_table.shape\\[0\\] == B = 1"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(2, 1, **I32), page_size=4, layout=DCPLayout())
    with pytest.raises(ValueError, match=r"block_table to be a 2-D signed .*, got torch.int32 tensor of shape \(2,\)"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(2, **I32), page_size=4, layout=DCPLayout())
    with pytest.raises(ValueError, match="layout to be a DCPLayout"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 1, **I32), page_size=4, layout=(1, 0, 1))
    with pytest.raises(ValueError, match="seq_lens to be a 1-D signed integer tensor, got torch.bool"):
        plan_step(torch.tensor([0, 1]), torch.tensor([True]), torch.zeros(1, 1, **I32), page_size=4, layout=DCPLayout())
    with pytest.raises(ValueError, match="page_size to be a positive multiple of interleave = 1, got True"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 2, **I32), page_size=True, layout=DCPLayout())


def test_plan_keeps_copies_of_the_metadata():
    # Kernels read the plan per layer: a caller's table changed after plan_step must not reach them
    # (its page ids were checked at plan time).
    qsl, sl, bt = torch.tensor([0, 1], **I32), torch.tensor([5], **I32), torch.zeros(1, 2, **I32)
    plan = plan_step(qsl, sl, bt, page_size=4, layout=DCPLayout())
    for t in (qsl, sl, bt):
        t.fill_(7)
    assert plan.query_start_loc.tolist() == [0, 1] and plan.seq_lens.tolist() == [5]
    assert plan.block_table.tolist() == [[0, 0]]


def test_plan_copies_are_row_major():
    # Stock kernels (FA2/FA3's block table) want stride 1 in the last dim: a transposed table is copied row-major.
    bt = torch.tensor([[3, 0], [1, 4], [2, 5]], **I32).t()  # (2, 3), strides (1, 2)
    plan = plan_step(torch.tensor([0, 1, 2], **I32), torch.tensor([9, 5], **I32), bt, page_size=4, layout=DCPLayout())
    assert plan.block_table.is_contiguous() and plan.block_table.tolist() == bt.tolist()


def test_unsigned_tables_are_refused_and_numpy_ints_accepted():
    np = pytest.importorskip("numpy")
    # uint8 would wrap the -1 that marks unused entries to page 255.
    with pytest.raises(ValueError, match="block_table to be a 2-D signed integer tensor, got torch.uint8"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.uint8), page_size=4,
                  layout=DCPLayout())  # fmt: skip
    plan = plan_step(torch.tensor([0, 1]), torch.tensor([5]), torch.tensor([[2, 0]]), page_size=np.int64(4),
                     layout=DCPLayout(2, 0, np.int64(2)))  # fmt: skip
    assert type(plan.page_size) is int and plan.page_size == 4 and plan.local_context_lens.tolist() == [2]


def test_write_new_tokens_checks_cache_and_new():
    plan = plan_step(torch.tensor([0, 2], **I32), torch.tensor([6], **I32), torch.tensor([[0, 1]], **I32),
                     page_size=4, layout=DCPLayout())  # fmt: skip
    cache, new = torch.zeros(2, 4, 1, 8), torch.randn(2, 1, 8)
    plan.write_new_tokens(cache, new)
    assert torch.equal(cache[1, :2], new)  # positions 4 and 5: page 1
    for bad_cache, bad_new, match in (
        (torch.zeros(4, 2, 1, 8), new, r"cache: \(P, page_size = 4, H_kv, D\), got \(4, 2, 1, 8\)"),
        (torch.zeros(8, 1, 8), new, r"cache: \(P, page_size = 4, H_kv, D\), got \(8, 1, 8\)"),
        (cache, torch.randn(5, 1, 8), r"new: \(T, H_kv, D\) = \(2, 1, 8\) torch.float32 like cache, got \(5, 1, 8\)"),
        (cache, new.bfloat16(), r"new: .* like cache, got \(2, 1, 8\) torch.bfloat16"),
        (cache[:1], new, r"page ids < cache.shape\[0\] = 1"),
    ):
        with pytest.raises(ValueError, match=match):
            plan.write_new_tokens(bad_cache, bad_new)
    # A layer's cache may be a view of a larger buffer (e.g. (P, layers, page, H_kv, D)): any strides.
    big = torch.zeros(2, 3, 4, 1, 8)
    plan.write_new_tokens(big[:, 1], new)
    assert torch.equal(big[1, 1, :2], new) and big[:, [0, 2]].eq(0).all() and big[0].eq(0).all()


def test_negative_page_ids_in_use_are_refused():
    bt = torch.arange(8, **I32).view(2, 4)
    bt[1, 1:] = -1  # request 1: seq 10 -> 4 slots on rank 1 -> 1 page; later columns are never read
    plan_step(torch.tensor([0, 1, 2], **I32), torch.tensor([4, 10], **I32), bt, page_size=4, layout=LAYOUT)
    bt[1, 0] = -1
    with pytest.raises(ValueError, match=r"page ids >= 0 in the first 1 entries of block_table\[1\], got \[-1\]"):
        plan_step(torch.tensor([0, 1, 2], **I32), torch.tensor([4, 10], **I32), bt, page_size=4, layout=LAYOUT)


def test_max_page_id_counts_only_the_pages_in_use():
    # Rank 1 of (N=2, I=2): seq 4 keeps 2 tokens there, in column 0. Column 1 is never read, so its
    # large id must not make a one-page cache look too small.
    plan = plan_step(torch.tensor([0, 1], **I32), torch.tensor([4], **I32), torch.tensor([[0, 99]], **I32),
                     page_size=4, layout=DCPLayout(2, 1, 2))  # fmt: skip
    assert plan.max_page_id == 0
    cache, new = torch.zeros(1, 4, 1, 2), torch.randn(1, 1, 2)
    plan.write_new_tokens(cache, new)  # position 3, rank 1's local slot 1 of page 0
    assert torch.equal(cache[0, 1], new[0]) and plan.write_slots.tolist() == [1]
    empty = plan_step(torch.zeros(1, **I32), torch.zeros(0, **I32), torch.zeros(0, 0, **I32), page_size=4,
                      layout=DCPLayout())  # fmt: skip
    assert empty.max_page_id == -1


def test_the_first_slot_of_page_0_is_written():
    plan = plan_step(torch.tensor([0, 1], **I32), torch.tensor([1], **I32), torch.tensor([[0]], **I32), page_size=4,
                     layout=DCPLayout())  # fmt: skip
    cache, new = torch.zeros(1, 4, 1, 2), torch.randn(1, 1, 2)
    plan.write_new_tokens(cache, new)
    assert plan.write_slots.tolist() == [0] and torch.equal(cache[0, 0], new[0]) and cache[0, 1:].eq(0).all()


def test_metadata_without_values_is_refused_by_name():
    meta = dict(device="meta", dtype=torch.int32)
    with pytest.raises(ValueError, match="expected query_start_loc, seq_lens and block_table with values, got meta"):
        plan_step(torch.zeros(2, **meta), torch.zeros(1, **meta), torch.zeros(1, 1, **meta), page_size=4,
                  layout=DCPLayout())  # fmt: skip
    with pytest.raises(ValueError, match="expected seq_lens on cpu like query_start_loc, got meta"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2], device="meta"), torch.zeros(1, 1, **I32), page_size=4,
                  layout=DCPLayout())  # fmt: skip
    with pytest.raises(ValueError, match="expected parents with values, got a meta tensor"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 1, **I32), page_size=4, layout=DCPLayout(),
                  parents=torch.tensor([-1], device="meta"))  # fmt: skip
    # write_new_tokens: a cache or new tokens on another device than the plan's (meta stands in for one)
    plan = plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 1, **I32), page_size=4, layout=DCPLayout())
    cache, new = torch.zeros(1, 4, 1, 8), torch.ones(1, 1, 8)
    for c, n, name in ((cache, new.to("meta"), "new"), (cache.to("meta"), new.to("meta"), "cache")):
        with pytest.raises(ValueError, match=f"expected {name} on cpu, the plan's device, got meta"):
            plan.write_new_tokens(c, n)


def test_write_new_tokens_refuses_new_of_other_heads_or_head_dim():
    plan = plan_step(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                     torch.tensor([[0, 1]], dtype=torch.int32), page_size=4, layout=DCPLayout())  # fmt: skip
    cache = torch.zeros(2, 4, 1, 8)
    for bad in (torch.randn(2, 1, 1), torch.randn(2, 2, 8)):  # (2, 1, 1) would broadcast over D silently
        with pytest.raises(ValueError, match=r"new: \(T, H_kv, D\) = \(2, 1, 8\) torch.float32 like cache"):
            plan.write_new_tokens(cache, bad)
    assert cache.eq(0).all()


def test_plan_step_names_a_block_table_on_another_device():
    with pytest.raises(ValueError, match="expected block_table on cpu like query_start_loc, got meta"):
        plan_step(torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int32, device="meta"),
                  page_size=4, layout=DCPLayout())  # fmt: skip


def test_a_table_too_narrow_for_one_of_several_requests_is_refused():
    # request 0 needs 1 page, request 1 needs 25: the widest need decides
    with pytest.raises(ValueError, match=r"at least 25 pages per request on every rank, got 2: .*\(request 1 "):
        plan_step(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([4, 100], dtype=torch.int32),
                  torch.zeros(2, 2, dtype=torch.int32), page_size=4, layout=DCPLayout())  # fmt: skip


@pytest.mark.parametrize("n,r,il,ps", [(1, 0, 1, 4), (2, 1, 2, 4), (3, 2, 1, 3), (4, 0, 2, 2), (4, 3, 2, 8)])
def test_expanded_context_plan_gives_each_token_its_causal_prefix(n, r, il, ps):
    layout = DCPLayout(n, r, il)
    ctx, q = [0, 1, n * il - 1, 13, 40], [3, 1, 16, 5, 2]  # contexts shorter than N*I: empty shards
    qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()])
    p = make(qsl.tolist(), [c + k for c, k in zip(ctx, q)], pages=40, page_size=ps, layout=layout)
    e = expanded_context_plan(p)
    t = sum(q)
    assert (e.num_tokens, e.batch_size, e.max_q_len) == (t, t, 1)
    assert e.query_start_loc.tolist() == list(range(t + 1)) and e.q_lens.tolist() == [1] * t
    seen = [c + j + 1 for c, k in zip(ctx, q) for j in range(k)]
    mine = [sum(1 for pos in range(s) if (pos // il) % n == r) for s in seen]  # positions this rank stores
    assert e.context_lens.tolist() == seen and e.local_context_lens.tolist() == mine
    assert e.max_local_context_len == max(mine) and e.max_context_len == max(seen)
    assert torch.equal(e.block_table, p.block_table[p.token_request])
    assert e.token_request.tolist() == list(range(t)) and e.token_offset.tolist() == [0] * t
    assert e.write_rows.numel() == 0 and e.query_mask is None and e.max_page_id == p.max_page_id
    with pytest.raises(ValueError, match="expected a causal step"):
        expanded_context_plan(make([0, 2], [5], parents=torch.tensor([-1, 0])))
