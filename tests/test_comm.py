"""Collectives on real gloo groups: both combines equal a local merge of all states."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from twostage_mla import comm
from twostage_mla.state import merge_states


def _states(world: int, dtype: torch.dtype, dv: int = 8):
    """Every rank's (o, lse) for every destination: (src, dst, T, H, Dv), (src, dst, T, H)."""
    g = torch.Generator().manual_seed(3)
    o = torch.randn(world, world, 5, 3, dv, generator=g).to(dtype)
    lse = torch.randn(world, world, 5, 3, generator=g) * 3
    lse[:, :, 0] = float("-inf")  # token 0: empty on every rank
    lse[0, :, 1] = float("-inf")  # token 1: empty on rank 0 (a short context)
    o[0, :, 1] = float("nan")  # garbage where empty must not leak
    return o, lse


def _combine(rank: int, world: int, dtype: torch.dtype, dv: int) -> dict:
    import torch.distributed as dist

    o, lse = _states(world, dtype, dv)
    out = {}
    for name in comm.COMBINE_METHODS:
        if name == "a2a":
            res = comm.combine_a2a(o[rank], lse[rank], dist.group.WORLD)
        else:
            res = comm.combine_ag_rs(o[rank], lse[rank], dist.group.WORLD)
        out[name] = res
    q = torch.full((4, 2, 6), float(rank)).to(dtype)
    buf, work = comm.gather_queries(q, dist.group.WORLD)
    work.wait()
    out["gathered"] = buf
    return out


# T*H = 15 is odd: with float64 the byte rows must still align for every view; with bf16 and
# Dv = 3 a rank's o is 90 bytes, which the all-to-all pads to 96.
@pytest.mark.parametrize(
    "world,dtype,dv", [(3, torch.float32, 8), (2, torch.bfloat16, 8), (2, torch.float64, 8), (2, torch.bfloat16, 3)]
)
def test_combines_equal_local_merge(world, dtype, dv):
    o, lse = _states(world, dtype, dv)
    for rank, res in enumerate(run_ranks(world, _combine, dtype, dv)):
        ref_o, ref_lse = merge_states(o[:, rank], lse[:, rank], out_dtype=torch.float32)
        for name in comm.COMBINE_METHODS:
            got_o, got_lse = res[name]
            assert got_o.dtype == torch.float32 and got_lse.dtype == torch.float32
            assert not got_o.isnan().any(), name
            torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_lse, ref_lse)
            assert torch.equal(got_o[0], torch.zeros_like(got_o[0])) and torch.isneginf(got_lse[0]).all()
        # rank-major: slice s holds rank s's queries
        assert [res["gathered"][s].unique().tolist() for s in range(world)] == [[float(s)] for s in range(world)]


def test_head_order_round_trip():
    x = torch.arange(2 * 3 * 6 * 4).view(2, 3, 6, 4)  # (N=2, T=3, H=6 as 2 kv heads x 3, D)
    kv_major = comm.from_rank_major(x, num_kv_heads=2)
    assert kv_major.shape == (3, 12, 4)
    # kv head 0 block = rank 0's heads 0..2 then rank 1's heads 0..2
    torch.testing.assert_close(kv_major[:, :3], x[0, :, :3])
    torch.testing.assert_close(kv_major[:, 3:6], x[1, :, :3])
    torch.testing.assert_close(comm.to_rank_major(kv_major, world_size=2, num_kv_heads=2), x)


def _no_tokens(rank: int, world: int) -> dict:
    import torch.distributed as dist

    o, lse = torch.randn(world, 0, 2, 8), torch.randn(world, 0, 2)
    return {
        "a2a": comm.combine_a2a(o, lse, dist.group.WORLD),
        "ag_rs": comm.combine_ag_rs(o, lse, dist.group.WORLD),
    }


def test_combines_of_no_tokens():
    for res in run_ranks(2, _no_tokens):
        for name in comm.COMBINE_METHODS:
            assert res[name][0].shape == (0, 2, 8) and res[name][1].shape == (0, 2), name


def _wrong_count(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    messages = []
    for o, lse in ((torch.randn(world + 1, 3, 2, 8), torch.randn(world + 1, 3, 2)),  # a state per rank, plus one
                   (torch.randn(world, 3, 2, 8), torch.randn(world, 2, 3))):  # lse of another (T, H)  # fmt: skip
        for fn in (comm.combine_a2a, comm.combine_ag_rs):
            try:
                fn(o, lse, dist.group.WORLD)
                messages.append("no error")
            except ValueError as e:
                messages.append(str(e))
    return messages


def test_states_not_matching_the_group_are_refused_before_the_collective():
    for messages in run_ranks(2, _wrong_count):
        assert len(messages) == 4
        for m in messages:
            assert m.startswith("expected o: (N = 2, T, H, Dv) and lse: (N, T, H) = o.shape[:3], got o ("), m


def _agreements(rank: int, world: int) -> dict:
    import torch.distributed as dist

    big = [2**63 - 1, -(2**63), -(2**63) + rank, rank, 1]  # 64-bit digests survive the all-reduce
    out = {"rows5": comm.agree("step", big, dist.group.WORLD, None), "rows2": comm.agree("layer", [rank, 7],
           dist.group.WORLD, "cpu")}  # fmt: skip
    try:  # rank 0 builds a layer while the others plan a step
        comm.agree("layer" if rank == 0 else "step", [1, 2], dist.group.WORLD, None)
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    out["after"] = comm.agree("step", [rank], dist.group.WORLD, None)  # the group is still in step
    return out


def test_agree_gathers_every_rank_row_and_refuses_other_kinds():
    for rank, res in enumerate(run_ranks(3, _agreements)):
        assert res["rows5"] == [[2**63 - 1, -(2**63), -(2**63) + r, r, 1] for r in range(3)]
        assert res["rows2"] == [[r, 7] for r in range(3)]
        assert res["mismatch"] == (
            "expected every rank of the DCP group to build its layers and plan its steps in the same order, got "
            "ranks [0] vs [1, 2] at different ones (1 = a layer built, 2 = a step planned: [1, 2, 2])"
        ), rank
        assert res["after"] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="expected kind in \\('layer', 'step'\\) and a row of up to 5 ints"):
        comm.agree("plan", [1], None, None)
    with pytest.raises(ValueError, match="a row of up to 5 ints, got 'step', \\[1, 2, 3, 4, 5, 6\\]"):
        comm.agree("step", [1, 2, 3, 4, 5, 6], None, None)


def test_digest_reads_the_values_of_a_view_not_its_storage():
    # The digest reads a tensor's raw bytes (ctypes, no NumPy): a view must hash its own values, at
    # its offset and stride, and as int64 whatever its integer dtype.
    g = torch.Generator().manual_seed(5)
    base = torch.randint(-(2**40), 2**40, (8, 3), generator=g)
    view = base[2:, 1]  # offset and stride: not the storage's first bytes
    assert comm.digest(view, 7) == comm.digest(view.clone(), 7)
    assert comm.digest(view, 7) != comm.digest(base[:6, 1], 7)
    small = torch.randint(-100, 100, (6,), generator=g, dtype=torch.int32)
    assert comm.digest(small) == comm.digest(small.long())
    changed = small.clone()
    changed[-1] += 1
    assert comm.digest(small) != comm.digest(changed)
    assert comm.digest(torch.empty(0, dtype=torch.long)) == comm.digest(torch.empty(0, dtype=torch.int32))
    assert comm.digest(torch.empty(0, dtype=torch.long)) != comm.digest(torch.zeros(1, dtype=torch.long))
