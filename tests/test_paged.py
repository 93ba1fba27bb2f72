"""Plan-time helpers of the fast backends, on the worked example of their module docstring."""

import torch

from twostage_mla.backends._paged import gather_slots, key_indptr, last_page_lens, page_lists, read_slots
from twostage_mla.layout import DCPLayout
from twostage_mla.plan import plan_step


def _plan():
    # page_size 4, local context lengths 6, 0, 3 (one new token each, one rank)
    bt = torch.tensor([[7, 2, 9], [5, 0, 0], [3, 1, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    return plan_step(qsl, torch.tensor([7, 1, 4], dtype=torch.int32), bt, page_size=4, layout=DCPLayout())


def test_worked_example():
    plan = _plan()
    indptr, indices = page_lists(plan.block_table, plan.local_context_lens, plan.page_size)
    assert indptr.tolist() == [0, 2, 2, 3] and indices.tolist() == [7, 2, 3]
    assert key_indptr(plan).tolist() == [0, 6, 6, 9]
    assert last_page_lens(plan).tolist() == [2, 0, 3]
    slots, kptr, total = gather_slots(plan)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 12, 13, 14] and kptr.tolist() == [0, 6, 6, 9] and total == 9


def test_a_full_last_page_holds_page_size_tokens():
    # local context lengths 4, 8, 5 at page_size 4: the first two end on a full page (4 tokens, not 0)
    bt = torch.arange(9, dtype=torch.int32).view(3, 3)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    plan = plan_step(qsl, torch.tensor([5, 9, 6], dtype=torch.int32), bt, page_size=4, layout=DCPLayout())
    assert plan.local_context_lens.tolist() == [4, 8, 5]
    assert last_page_lens(plan).tolist() == [4, 4, 1]


def test_no_pages_used_still_gives_one_index():
    bt = torch.zeros(2, 1, dtype=torch.int32)
    indptr, indices = page_lists(bt, torch.zeros(2, dtype=torch.int32), 4)
    assert indptr.tolist() == [0, 0, 0] and indices.tolist() == [0]


def test_read_slots_of_contiguous_and_page_strided_caches():
    # A layer's cache may be a slice of a larger (P, layers, page, H_kv, D) buffer: read by
    # (page, offset) there, not through a reshape that would copy the whole cache each layer.
    big = torch.randn(6, 3, 4, 2, 5)
    slots = torch.tensor([[0, 5, 23], [7, 7, 12]])
    for cache in (big[:, 1], big[:, 1].contiguous(), big[:, 1, :, :, :3]):
        want = torch.stack([torch.stack([cache[s // 4, s % 4] for s in row]) for row in slots.tolist()])
        assert torch.equal(read_slots(cache, slots), want)


def test_read_slots_never_copies_a_page_strided_cache():
    # One real page behind a stride-0 view of 2**40 pages: a reshape would copy the whole cache (it
    # cannot be allocated), reading by (page, offset) touches only the slots asked for.
    page = torch.randn(1, 4, 2, 8)
    cache = page.expand(2**40, 4, 2, 8)
    slots = torch.tensor([[0, 5, 2**41 + 3], [7, 1, 6]])
    assert torch.equal(read_slots(cache, slots), page[0][slots % 4])
