import pytest
import torch

from twostage_mla.layout import DCPLayout, kv_slots, local_index, local_len, local_pages, owner
from twostage_mla.plan import plan_step


def brute(n_ranks: int, il: int, length: int):
    own = [(p // il) % n_ranks for p in range(length)]
    idx, count = [], [0] * n_ranks
    for p in range(length):
        idx.append(count[own[p]])
        count[own[p]] += 1
    return own, idx, count


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("il", [1, 2, 3, 16])
def test_formulas_match_brute_force(n_ranks, il):
    length = 3 * n_ranks * il + 5
    own, idx, _ = brute(n_ranks, il, length)
    p = torch.arange(length)
    assert owner(p, n_ranks, il).tolist() == own
    assert local_index(p, n_ranks, il).tolist() == idx
    for L in range(length + 1):
        counts = brute(n_ranks, il, L)[2]
        lens = torch.full((n_ranks,), L)
        for r in range(n_ranks):
            assert local_len(L, n_ranks, il, r) == counts[r]  # python ints
            assert local_len(lens, n_ranks, il, r)[r].item() == counts[r]  # tensors
            for page in (1, il, 3 * il):
                assert local_pages(L, n_ranks, il, r, page) == -(-counts[r] // page)
                assert local_pages(L, n_ranks, il, r, page) <= local_pages(L, n_ranks, il, 0, page)  # rank 0 most


def test_worked_example_from_docstring():
    p = torch.arange(9)
    assert owner(p, 2, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert local_index(p, 2, 2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 4]
    assert (local_len(9, 2, 2, 0), local_len(9, 2, 2, 1)) == (5, 4)
    # contexts shorter than N*I leave later ranks empty
    assert [local_len(3, 4, 2, r) for r in range(4)] == [2, 1, 0, 0]


@pytest.mark.parametrize("n_ranks,il,page", [(1, 1, 4), (2, 1, 3), (3, 2, 4), (4, 16, 16)])
def test_kv_slots_match_paged_layout(n_ranks, il, page):
    g = torch.Generator().manual_seed(0)
    lengths = [0, 7, 50, 3]
    for r in range(n_ranks):
        layout = DCPLayout(n_ranks, r, il)
        need = max(-(-local_len(L, n_ranks, il, r) // page) for L in lengths)
        table = torch.randperm(4 * max(need, 1), generator=g)[: 4 * max(need, 1)].view(4, -1).int()
        pos = torch.cat([torch.arange(L) for L in lengths])
        req = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
        slots = kv_slots(pos, req, table, page, layout).tolist()
        own, idx, _ = brute(n_ranks, il, max(lengths))
        for s, p_, b in zip(slots, pos.tolist(), req.tolist()):
            if own[p_] != r:
                assert s == -1
            else:
                li = idx[p_]
                assert s == int(table[b, li // page]) * page + li % page


def test_kv_slots_with_an_empty_table():
    table = torch.zeros(1, 0, dtype=torch.int32)
    slots = kv_slots(torch.arange(3), torch.zeros(3, dtype=torch.long), table, 4, DCPLayout(2, 1, 4))
    assert slots.tolist() == [-1, -1, -1]


def test_kv_slots_refuse_a_table_too_narrow():
    # Rank 0 of N=2, I=4, page 4: positions 16 and 20 are its local slots 8 and 12, past a 2-page
    # table; clamped, they would land on the live slots of positions 8 and 12.
    table = torch.tensor([[3, 5]], dtype=torch.int32)
    pos = torch.tensor([0, 8, 16, 20])
    with pytest.raises(ValueError, match=r"at least 3 pages per request, got 2: position 16 is this rank's local slot"):
        kv_slots(pos, torch.zeros(4, dtype=torch.long), table, 4, DCPLayout(2, 0, 4))
    with pytest.raises(ValueError, match=r"at least 1 pages per request, got 0"):
        kv_slots(pos, torch.zeros(4, dtype=torch.long), table[:, :0], 4, DCPLayout(2, 0, 4))
    assert kv_slots(pos[:2], torch.zeros(2, dtype=torch.long), table, 4, DCPLayout(2, 0, 4)).tolist() == [12, 20]


def test_kv_slots_refuse_a_padding_entry_for_a_position_this_rank_owns():
    # build_shard pads with -1: position 8 (rank 0's local slot 4, page column 1) would wrap to page -1.
    table = torch.tensor([[3, -1]], dtype=torch.int32)
    pos = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match=r"page id >= 0 in block_table\[0, 1\] for position 8, .* got -1"):
        kv_slots(pos, torch.zeros(3, dtype=torch.long), table, 4, DCPLayout(2, 0, 4))
    # positions 4 and 12 belong to rank 1: -1, whatever their column holds (12's is the -1 padding entry)
    foreign = torch.tensor([0, 4, 12])
    assert kv_slots(foreign, torch.zeros(3, dtype=torch.long), table, 4, DCPLayout(2, 0, 4)).tolist() == [12, -1, -1]


def test_layout_rejects_bad_values():
    for args, match in [
        ((0, 0, 1), "expected world_size to be an int >= 1, got 0"),
        ((2, 0, 0), "expected interleave to be an int >= 1, got 0"),
        ((2, 2, 1), r"expected 0 <= rank < world_size = 2, got rank=2"),
        ((2, -1, 1), "expected rank to be an int >= 0, got -1"),
        ((2, 0, True), "expected interleave to be an int >= 1, got True"),
        ((2.0, 0, 1), "expected world_size to be an int >= 1, got 2.0"),
    ]:
        with pytest.raises(ValueError, match=match):
            DCPLayout(*args)
    np = pytest.importorskip("numpy")
    layout = DCPLayout(np.int64(2), np.int32(1), 4)  # NumPy ints, kept as Python ints
    assert (type(layout.world_size), type(layout.rank)) == (int, int)


def test_formulas_refuse_bad_arguments():
    # Each would give a plausible number: local_len(9, 2, 2, rank=5) = 4, owner(3, -2, 1) = -1.
    for call, match in [
        (lambda: local_len(9, 2, 2, 5), r"0 <= rank < world_size = 2, got rank=5"),
        (lambda: local_len(9, 2, 2, -1), "expected rank to be an int >= 0, got -1"),
        (lambda: local_len(-5, 2, 2, 0), "expected length to be an int >= 0, got -5"),
        (lambda: local_len(9.0, 2, 2, 0), "expected length to be an int >= 0, got 9.0"),
        (lambda: local_len(torch.tensor([9.0]), 2, 2, 0), "expected length to be an int or an integer tensor"),
        (lambda: owner(3, -2, 1), "expected world_size to be an int >= 1, got -2"),
        (lambda: owner(True, 2, 1), "expected p to be an int >= 0, got True"),
        (lambda: local_index(3, 2, 0), "expected interleave to be an int >= 1, got 0"),
        (lambda: local_pages(9, 2, 2, 0, 0), "expected page_size to be an int >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    # Integer tensors of any integer dtype, and NumPy ints, still work.
    assert local_len(torch.tensor([9], dtype=torch.int16), 2, 2, 0).tolist() == [5]
    np = pytest.importorskip("numpy")
    assert local_pages(np.int64(9), np.int32(2), 2, 0, 4) == 2


def test_kv_slots_refuse_bad_arguments():
    pos, req, table = torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([[2]], dtype=torch.int32)
    lay, want = DCPLayout(), "to be a {}-D signed integer tensor, got torch.{}"
    for change, match in [
        # uint8: the -1 of unused entries would read as page 255; a float table would be truncated
        (dict(block_table=table.to(torch.uint8)), "expected block_table " + want.format(2, "uint8")),
        (dict(block_table=table.float()), "expected block_table " + want.format(2, "float32")),
        (dict(positions=pos.float()), "expected positions " + want.format(1, "float32")),
        (dict(positions=torch.tensor([0, -1])), "expected positions >= 0, got -1"),
        (dict(request=torch.tensor([0, -1])), r"expected 0 <= request < block_table.shape\[0\] = 1, got -1"),
        (dict(request=torch.tensor([0, 1])), r"expected 0 <= request < block_table.shape\[0\] = 1, got 1"),
        (dict(request=torch.tensor([0])), r"expected request.shape == positions.shape = \(2,\), got \(1,\)"),
        (dict(page_size=-2), "expected page_size to be a positive multiple of interleave = 1, got -2"),
        (dict(page_size=1.5), "expected page_size to be a positive multiple of interleave = 1, got 1.5"),
        (dict(layout=None), "expected layout to be a DCPLayout, got NoneType"),
    ]:
        args = {**dict(positions=pos, request=req, block_table=table, page_size=4, layout=lay), **change}
        with pytest.raises(ValueError, match=match):
            kv_slots(**args)
    assert kv_slots(pos, req, table, 4, lay).tolist() == [8, 9]


def test_layout_takes_numpy_ints_as_python_ints():
    # Engines read sizes from configs, often as NumPy scalars: the same layout (a plan's check compares them).
    np = pytest.importorskip("numpy")
    layout = DCPLayout(np.int64(4), np.int32(1), np.int64(16))
    assert layout == DCPLayout(4, 1, 16) and all(type(v) is int for v in vars(layout).values())


def _vllm_dcp_slots(pos, req, table, block_size, n, rank, il):
    """vLLM's DCP slot mapping as its docs and code describe it (block_table.py): one block table shared by
    the ranks, whose blocks are virtual blocks of block_size * N positions, block_size a multiple of I."""
    v = pos % (block_size * n)
    offset = (v // (n * il)) * il + v % il
    slots = table.long()[req, pos // (block_size * n)] * block_size + offset
    return torch.where((v // il) % n == rank, slots, torch.full_like(slots, -1))


@pytest.mark.parametrize("n_ranks,il,block_size", [(1, 1, 16), (2, 1, 4), (3, 2, 4), (4, 4, 8), (2, 16, 64)])
def test_layout_is_vllms_dcp_layout(n_ranks, il, block_size):
    """vLLM's cp_kv_cache_interleave_size is I: its shared block table (width cdiv(max_model_len, block_size * N),
    zero-padded) is a valid block_table for plan_step on every rank, its slot mapping is kv_slots' and
    plan.new_token_slots()', its local lengths local_len's."""
    g = torch.Generator().manual_seed(n_ranks * 100 + il)
    lengths = [0, 1, il * n_ranks - 1, block_size * n_ranks + 3, 5 * block_size * n_ranks]
    q_lens = torch.tensor([0, 1, min(3, il * n_ranks - 1), 4, 2])  # the step's new tokens end each request
    width = max(-(-L // (block_size * n_ranks)) for L in lengths)
    table = torch.randperm(len(lengths) * width, generator=g).view(len(lengths), width).int()
    padded = torch.cat([table, torch.zeros(len(lengths), 2, dtype=torch.int32)], dim=1)  # max_model_len beyond
    pos = torch.cat([torch.arange(L) for L in lengths])
    req = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).int()
    new = torch.cat([torch.arange(L - q, L) for L, q in zip(lengths, q_lens.tolist())])  # their positions
    new_req = torch.repeat_interleave(torch.arange(len(lengths)), q_lens)
    for L in range(2 * block_size * n_ranks + 1):
        assert local_pages(L, n_ranks, il, 0, block_size) == -(-L // (block_size * n_ranks))  # rank 0's need
    for r in range(n_ranks):
        layout = DCPLayout(n_ranks, r, il)
        assert torch.equal(kv_slots(pos, req, table, block_size, layout),
                           _vllm_dcp_slots(pos, req, table, block_size, n_ranks, r, il))  # fmt: skip
        plan = plan_step(qsl, seq_lens, padded, page_size=block_size, layout=layout)
        assert torch.equal(plan.new_token_slots(), _vllm_dcp_slots(new, new_req, padded, block_size, n_ranks, r, il))
        for L in range(2 * block_size * n_ranks + 1):
            base = L // il // n_ranks * il  # vLLM's get_dcp_local_seq_lens
            assert local_len(L, n_ranks, il, r) == base + min(max(L - base * n_ranks - r * il, 0), il)
