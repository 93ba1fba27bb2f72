"""The whole layer on real multi-process gloo groups, against the float64 oracle."""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests._views import strided_last
from tests.dist_helpers import run_ranks
from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, comm, synthetic

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# MLA with 2 heads per rank, D = 16 + 8, page 4: the small layer of the refusal and NaN tests
SMALL_MLA = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.2)


def cases(world: int) -> list[dict]:
    """A covering grid: every (I, page size) with both formats, both combines, both dtypes."""
    rng = random.Random(world)
    out = []
    for n, (il, ps) in enumerate([(1, 1), (1, 16), (2, 2), (2, 8), (16, 16), (16, 32)]):
        for fmt, combine in itertools.product(("mla", "gqa"), ("a2a", "ag_rs")):
            span = world * il
            # contexts: empty, shorter than N*I (empty shards), around N*I, longer
            ctx = [0, rng.randrange(1, span + 1), span, rng.randrange(span, 6 * span + 40)]
            ql = [rng.randint(1, 16) for _ in ctx]
            ql[rng.randrange(len(ql))] = 16
            if len(out) % 5 == 1:  # a plain decode step: q_len 1 everywhere (each token still sees itself)
                ql = [1] * len(ctx)
            out.append(
                dict(
                    il=il,
                    ps=ps,
                    fmt=fmt,
                    combine=combine,
                    ctx=ctx,
                    ql=ql,
                    dtype=(torch.float32, torch.bfloat16)[(n + len(out)) % 2],
                    tree=len(out) % 3 == 0,
                    seed=len(out),
                    scale=rng.uniform(0.3, 1.5),  # times d**-0.5: not the default a backend might assume
                )
            )
    return out


def _grid(rank: int, world: int, grid: list[dict], context_pass: str = "split") -> list[tuple[dict, float]]:
    results = []
    for c in grid:
        if context_pass == "expand" and c["tree"]:  # refused (test_expand_refuses_tree_steps)
            continue
        mla = c["fmt"] == "mla"
        # MLA: 1 or 2 heads per rank, D = 16 + 8; GQA: 4 heads per rank over 2 KV heads, D=16, Dv=8
        h, hk, d, dv = (1 + c["seed"] % 2, 1, 24, 16) if mla else (4, 2, 16, 8)
        cfg = AttentionConfig(h, d, dv, c["ps"], c["scale"] * d**-0.5, hk, c["fmt"])
        layout = DCPLayout(world, rank, c["il"])
        step = synthetic.make_step(
            c["ctx"],
            c["ql"],
            heads=h * world,
            head_dim=d,
            head_dim_v=dv,
            kv_heads=hk,
            mla=mla,
            tree=c["tree"],
            dtype=c["dtype"],
            seed=c["seed"],
        )
        # Unwritten cache slots hold NaN, as in an engine's torch.empty cache: never read them.
        x = synthetic.rank_inputs(
            step, layout, c["ps"], mla=mla, dtype=c["dtype"], device="cpu", seed=c["seed"], fill=float("nan")
        )
        attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, combine=c["combine"], dtype=c["dtype"],
                                 context_pass=context_pass)
        plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
        assert (plan.context_plan is not None) == (context_pass == "expand" and x.k.shape[0] > 0)
        if context_pass == "expand":  # the new tokens are in the shard already: rewritten, as an engine would
            plan.write_new_tokens(x.k_cache, x.k)
            if not mla:
                plan.write_new_tokens(x.v_cache, x.v)
        out, lse = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan, return_lse=True)
        ref_o, ref_lse = synthetic.oracle(step, cfg.scale, slice(rank * h, (rank + 1) * h))
        assert out.dtype == c["dtype"] and lse.dtype == torch.float32
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        rel = ((out.double() - ref_o).abs().max() / ref_o.abs().max()).item()
        lse_err = (lse.double() - ref_lse).abs().max().item()
        results.append((c, rel, lse_err))
    return results


@pytest.mark.parametrize("context_pass", ["split", "expand"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layer_matches_oracle(world, context_pass):
    grid = cases(world)
    results = run_ranks(world, _grid, grid, context_pass)
    assert len(results[0]) >= len(grid) // 2
    for rank_results in results:
        for c, rel, lse_err in rank_results:
            assert rel <= TOL[c["dtype"]], (c, rel)
            assert lse_err <= 1e-4, (c, lse_err)


def _nan_query(rank: int, world: int) -> list[tuple[str, bool, bool, float]]:
    """NaN in one query (rank 0's token 3, head 0): that row's output is NaN, every other one exact."""
    cfg = SMALL_MLA
    step = synthetic.make_step([5, 30, 0], [2, 4, 3], heads=2 * world, head_dim=24, head_dim_v=16, seed=4)
    x = synthetic.rank_inputs(step, DCPLayout(world, rank, 2), 4, mla=True, dtype=torch.float32, device="cpu")
    if rank == 0:
        x.q[3, 0, 5] = float("nan")
    ref_o, _ = synthetic.oracle(step, cfg.scale, slice(rank * 2, rank * 2 + 2))
    bad = torch.zeros(ref_o.shape[:2], dtype=torch.bool)
    bad[3, 0] = rank == 0
    out = []
    for combine in ("a2a", "ag_rs"):
        attn = TwoStageAttention(
            cfg, DCPLayout(world, rank, 2), group=dist.group.WORLD, combine=combine, dtype=torch.float32
        )
        plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        o, lse = attn(x.q, x.k, None, x.k_cache, None, plan, return_lse=True)
        err = (o[~bad].double() - ref_o[~bad]).abs().max().item()
        nan_row = bool(o[bad].isnan().all() and lse[bad].isnan().all())
        out.append((combine, nan_row, bool(o[~bad].isfinite().all()), err))
    return out


def test_nan_query_reaches_its_row_and_no_other():
    # Not hidden as 0 by a merge that takes a NaN state for an empty one, and not spread to other rows.
    for rank, results in enumerate(run_ranks(2, _nan_query)):
        for combine, nan_row, finite_rest, err in results:
            assert nan_row and finite_rest and err < 1e-5, (rank, combine, nan_row, finite_rest, err)


@pytest.mark.parametrize("fmt", ["mla", "gqa"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_nan_in_a_fresh_key_reaches_only_the_tokens_that_see_it(fmt, tree):
    """The query pass: a key a token does not see (a later token, a tree sibling) adds nothing, not 0 x NaN."""
    mla = fmt == "mla"
    cfg = SMALL_MLA if mla else AttentionConfig(4, 16, 12, 4, 0.25, num_kv_heads=2, kv_format="gqa")
    step = synthetic.make_step([5, 9], [4, 3], heads=cfg.num_heads, head_dim=cfg.head_dim,
                               head_dim_v=cfg.head_dim_v, kv_heads=cfg.num_kv_heads, mla=mla, seed=3)  # fmt: skip
    parents = torch.tensor([-1, 0, 0, 1, -1, 0, 1]) if tree else None
    x = synthetic.rank_inputs(step, DCPLayout(), 4, mla=mla, dtype=torch.float32, device="cpu")
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=parents)
    k, v = x.k.clone(), None if mla else x.v.clone()
    (k if mla else v)[2] = float("nan")  # token 2 of request 0: its fresh V
    out = attn(x.q, k, v, x.k_cache, x.v_cache, plan)
    sees = plan.query_mask[0, :, 2] if tree else torch.arange(4) >= 2  # tokens of request 0 that see token 2
    bad = torch.cat([sees, torch.zeros(3, dtype=torch.bool)])
    assert out[bad].isnan().all() and not out[~bad].isnan().any(), out.isnan().any(dim=(1, 2))
    ref, _ = synthetic.oracle(replace(step, parents=parents), cfg.scale)
    assert (out[~bad].double() - ref[~bad]).abs().max() < 1e-5


def _bad_inputs(rank: int, world: int) -> list[str]:
    """Every rank makes the same mistakes; each must raise before any collective."""
    layout = DCPLayout(world, rank, 2)
    cfg = SMALL_MLA
    step = synthetic.make_step([5, 9], [2, 3], heads=2 * world, head_dim=24, head_dim_v=16, seed=1)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu")
    attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, dtype=torch.float32)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    messages = []

    def expect(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")

    expect(attn, x.q[:, :1], x.k, None, x.k_cache, None, plan)  # head count
    expect(attn, x.q[:-1], x.k, None, x.k_cache, None, plan)  # token count
    expect(attn, x.q.bfloat16(), x.k, None, x.k_cache, None, plan)  # dtype
    expect(attn, x.q, x.k[..., :20], None, x.k_cache, None, plan)  # head dim
    expect(attn, x.q, x.k, None, x.k_cache[:, :2], None, plan)  # page size
    expect(attn, x.q, x.k, x.k[..., :16], x.k_cache, None, plan)  # v given for MLA
    expect(attn, x.q, x.k, None, x.k_cache, None, "not a plan")
    other = TwoStageAttention(cfg, DCPLayout(world, rank, 1), group=dist.group.WORLD, dtype=torch.float32)
    expect(attn, x.q, x.k, None, x.k_cache, None, other.plan(x.query_start_loc, x.seq_lens, x.block_table))
    expect(TwoStageAttention, cfg, DCPLayout(world + 1, 0, 2), group=dist.group.WORLD)  # group size
    expect(TwoStageAttention, cfg, DCPLayout(world, (rank + 1) % world, 2), group=dist.group.WORLD)
    expect(TwoStageAttention, cfg, layout)  # no group
    expect(TwoStageAttention, cfg, DCPLayout(), group=dist.group.WORLD)  # a layout of one rank, a group of more
    expect(attn, x.q, x.k, None, x.k_cache[:1], None, plan)  # a cache with fewer pages than the table names
    expect(plan.write_new_tokens, x.k_cache[:1], x.k)
    expect(TwoStageAttention, cfg, layout, group=dist.group.WORLD, combine="ring")
    expect(TwoStageAttention, cfg, layout, group=dist.group.WORLD, backend="nope")
    expect(
        TwoStageAttention,
        AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=3, scale=0.2),
        layout,
        group=dist.group.WORLD,
    )
    # One rank's bad table: every rank raises in plan(), none goes on into a layer call alone.
    calls = []
    attn.backend.invalidate_plans = lambda: calls.append(1)
    table = x.block_table.clone()
    if rank == 0:
        table[0, 0] = -1
    expect(attn.plan, x.query_start_loc, x.seq_lens, table)
    expect(attn.plan, x.query_start_loc, x.seq_lens, x.block_table, num_pages=1)
    # Ranks that disagree on the step (its queries are the same on every rank): refused on all. (Here
    # rank 1's longer requests use padding entries of its table: page 0 stands in, so that it plans.)
    table = x.block_table.clamp(min=0)
    expect(attn.plan, x.query_start_loc, x.seq_lens + rank, table)
    expect(attn.plan, x.query_start_loc, x.seq_lens.flip(0) if rank else x.seq_lens, table)  # same sum
    # Requests swapped in pairs (10, 20, 30, 20 against 20, 10, 20, 30): equal position-weighted sums too.
    four = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
    lens = torch.tensor([[10, 20, 30, 20], [20, 10, 20, 30]][rank % 2], dtype=torch.int32)
    expect(attn.plan, four, lens, torch.zeros(4, 8, dtype=torch.int32))
    tree = torch.tensor([-1, 0, -1, 0, 1], dtype=torch.int64)
    expect(attn.plan, x.query_start_loc, x.seq_lens, x.block_table, parents=tree if rank else None)
    # Layers that differ across ranks: a hang (combine) or a wrong answer (scale, interleave) later.
    # They are refused when built, so a layer that shares another's plan is covered too.
    for kw in (dict(combine=("a2a", "ag_rs")[rank % 2]), dict(cfg=replace(cfg, scale=0.2 + 0.1 * rank))):
        expect(TwoStageAttention, kw.pop("cfg", cfg), layout, group=dist.group.WORLD, dtype=torch.float32, **kw)
    # ... compared by value: scale 1 and 1.0 are the same layer.
    same = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=(1, 1.0)[rank % 2])
    expect(TwoStageAttention(same, layout, group=dist.group.WORLD, dtype=torch.float32).plan, x.query_start_loc,
           x.seq_lens, x.block_table)  # fmt: skip
    # One rank's mistake in building a layer: every rank raises, none waits for it in plan().
    expect(TwoStageAttention, cfg, layout, group=dist.group.WORLD, combine="ring" if rank == 1 else "a2a")
    # Each of the steps the group refused on this layer dropped the earlier plans on every rank alike
    # (FlashInfer's wrappers hold one step's plan; those of the ranks that accepted were re-planned).
    assert calls == [1] * 6, calls
    # A step with no tokens (every rank has the same T): empty outputs, no collective.
    none = attn.plan(torch.zeros(3, dtype=torch.int32), x.seq_lens - torch.tensor([2, 3], dtype=torch.int32),
                     x.block_table)  # fmt: skip
    o, lse = attn(x.q[:0], x.k[:0], None, x.k_cache, None, none, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (0, 2)
    # A layer built on one rank while the other plans a step: both raise (not another collective's numbers).
    if rank == 0:
        expect(TwoStageAttention, cfg, layout, group=dist.group.WORLD, dtype=torch.float32)
    else:
        expect(attn.plan, x.query_start_loc, x.seq_lens, x.block_table)
    # the group still works: a good call after all the bad ones
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    out = attn(x.q, x.k, None, x.k_cache, None, plan)
    assert torch.isfinite(out).all()
    return messages


def _build_on_another_group(rank: int, world: int) -> str | None:
    if rank:  # never joins rank 0's group in an agreement: rank 0 must not wait for it
        return None
    cfg = SMALL_MLA
    try:
        TwoStageAttention(cfg, DCPLayout(world + 1, 0), group=dist.group.WORLD, dtype=torch.float32)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_rank_given_another_group_raises_alone():
    message = run_ranks(2, _build_on_another_group)[0]
    assert "expected group of size 3 with this process at rank 0 (the layout), got size 2" in message


@pytest.mark.parametrize("world", [2])
def test_bad_input_raises_before_any_collective(world):
    for messages in run_ranks(world, _bad_inputs):
        expected = [
            r"q.shape == \(\d+, 2, 24\), got \(\d+, 1, 24\)",
            r"q.shape == \(\d+, 2, 24\)",
            r"q.dtype == torch.float32, got torch.bfloat16",
            r"k.shape == \(\d+, 1, 24\), got \(\d+, 1, 20\)",
            r"k_cache.shape == \(\*, 4, 1, 24\)",
            r"v=None and v_cache=None for MLA",
            r"plan from plan\(\) of a layer with this config.*got str",
            r"plan from plan\(\) of a layer with this config.*got backend 'reference', .*interleave=1",
            r"group of size 3 .* got size 2",
            r"this process at rank [01] .* got size 2, rank [01]",
            r"process group of size 2, got group=None",
            r"group of size 1 with this process at rank 0 \(the layout\), got size 2",
            r"block_table page ids < k_cache.shape\[0\] = 1 \(pages of this rank's cache\), got page id \d+",
            r"block_table page ids < cache.shape\[0\] = 1",
            r"combine in \('a2a', 'ag_rs'\), got 'ring'",
            r"backend to be 'auto' or one of .* got 'nope'",
            r"page_size to be a multiple of interleave = 2, got 3",
            r"page ids >= 0 in the first \d+ entries of block_table\[0\]|a refusal on rank\(s\) \[0\]",
            r"block_table page ids < num_pages = 1 \(pages of this rank's cache\)",
            r"same query_start_loc, seq_lens and parents on every rank .*got different ones on ranks \[0\] vs "
            r"\[1\] \(rank 0: T=5 B=2, rank 1: T=5 B=2\)",
            r"same query_start_loc, seq_lens and parents on every rank",
            r"same query_start_loc, seq_lens and parents on every rank .* \(rank 0: T=8 B=4, rank 1: T=8 B=4\)",
            r"same query_start_loc, seq_lens and parents on every rank",
            r"same layer on every rank of the DCP group \(config, .*combine, dtype, context_pass\), got different "
            r"ones on ranks \[0\] vs \[1\]",
            r"same layer on every rank of the DCP group",
            r"^no error$",
            r"combine in \('a2a', 'ag_rs'\), got 'ring'|accept this layer, got a refusal on rank\(s\) \[1\]",
            r"build its layers and plan its steps in the same order, got ranks \[0\] vs \[1\] at different ones "
            r"\(1 = a layer built, 2 = a step planned: \[1, 2\]\)",
        ]
        assert len(messages) == len(expected), messages
        for m, pattern in zip(messages, expected):
            assert re.search(pattern, m), (pattern, m)


def _one_rank_group(rank: int, world: int) -> int:
    calls = []
    real = comm.agree
    comm.agree = lambda *a, **k: calls.append(a) or real(*a, **k)
    cfg = SMALL_MLA
    step = synthetic.make_step([5], [2], heads=2, head_dim=24, head_dim_v=16)
    x = synthetic.rank_inputs(step, DCPLayout(), 4, mla=True, dtype=torch.float32, device="cpu")
    attn = TwoStageAttention(cfg, DCPLayout(), group=dist.group.WORLD, dtype=torch.float32)
    attn(x.q, x.k, None, x.k_cache, None, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
    return len(calls)


def test_a_group_of_one_rank_agrees_on_nothing():
    assert run_ranks(1, _one_rank_group) == [0]  # no all-reduce: nothing to agree with


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads to be a multiple of num_kv_heads = 3, got 4"):
        AttentionConfig(4, 16, 16, 4, 0.1, 3, "gqa")
    with pytest.raises(ValueError, match="num_kv_heads == 1 and head_dim_v <= head_dim for MLA .*kv_format='gqa'"):
        AttentionConfig(4, 16, 16, 4, 0.1, 2, "mla")
    with pytest.raises(ValueError, match=r"device to be a torch.device or a string like 'cuda:0', got 'gpu0'"):
        TwoStageAttention(AttentionConfig(4, 16, 16, 4, 0.1), DCPLayout(), device="gpu0")
    with pytest.raises(ValueError, match="num_kv_heads == 1 and head_dim_v <= head_dim for MLA"):
        AttentionConfig(4, 16, 32, 4, 0.1)
    with pytest.raises(ValueError, match=r"fuse_query in \(None, True, False\), got 'yes'"):
        TwoStageAttention(AttentionConfig(4, 16, 16, 4, 0.1), DCPLayout(), fuse_query="yes")
    with pytest.raises(ValueError, match=r"fuse_query in \(None, True, False\), got 1$"):  # 1 == True, quoted as given
        TwoStageAttention(AttentionConfig(4, 16, 16, 4, 0.1), DCPLayout(), fuse_query=1)
    with pytest.raises(ValueError, match="kv_format 'mla' or 'gqa'"):
        AttentionConfig(4, 16, 16, 4, 0.1, 1, "mha")
    with pytest.raises(ValueError, match="num_heads to be an int >= 1, got 0"):
        AttentionConfig(0, 16, 16, 4, 0.1)
    with pytest.raises(ValueError, match="page_size to be an int >= 1, got True"):
        AttentionConfig(4, 16, 16, True, 0.1)
    # AttentionConfig.mla names its own arguments (rope_dim=True would be taken as 1)
    for kw, match in [(dict(rope_dim=True), "rope_dim to be an int >= 0, got True"),
                      (dict(kv_lora_rank="16"), "kv_lora_rank to be an int >= 1, got '16'")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            AttentionConfig.mla(**{**dict(num_heads=4, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.1), **kw})
    with pytest.raises(ValueError, match="expected group to be a torch.distributed ProcessGroup or None, got 0"):
        TwoStageAttention(AttentionConfig(4, 16, 16, 4, 0.1), DCPLayout(), group=0)
    with pytest.raises(ValueError, match=r"got GroupMember.NON_GROUP_MEMBER \(this process is not in that group\)"):
        TwoStageAttention(AttentionConfig(4, 16, 16, 4, 0.1), DCPLayout(), group=dist.GroupMember.NON_GROUP_MEMBER)
    for bad in (0.0, float("inf"), float("nan"), torch.tensor(0.1), True):
        with pytest.raises(ValueError, match="scale to be a finite real number > 0"):
            AttentionConfig(4, 16, 16, 4, bad)
    # Sizes and scale from a model config as NumPy scalars: the same config as Python numbers.
    np = pytest.importorskip("numpy")
    from_numpy = AttentionConfig(np.int64(4), np.int32(16), 16, 4, np.float32(0.1))
    assert from_numpy == AttentionConfig(4, 16, 16, 4, float(np.float32(0.1)))
    assert type(from_numpy.num_heads) is int and type(from_numpy.scale) is float
    cfg = AttentionConfig(4, 16, 16, 4, 0.1)
    assert TwoStageAttention(cfg, DCPLayout(), device="cpu:0").device == torch.device("cpu")
    with pytest.raises(ValueError, match="expected dtype to be a torch.dtype .* got 'bfloat16'"):
        TwoStageAttention(cfg, DCPLayout(), dtype="bfloat16")
    if not torch.cuda.is_available():  # the README's device="cuda" on a machine without one
        with pytest.raises(ValueError, match="expected device 'cuda' to exist, but torch.cuda.is_available"):
            TwoStageAttention(cfg, DCPLayout(), device="cuda")


def _one_rank_step(cfg: AttentionConfig, **kw):
    layout = DCPLayout()
    step = synthetic.make_step(
        [5, 9],
        [2, 3],
        heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim_v,
        tree=kw.pop("tree", False),
        seed=1,
    )
    x = synthetic.rank_inputs(step, layout, cfg.page_size, mla=True, dtype=torch.float32, device="cpu")
    return x, TwoStageAttention(cfg, layout, dtype=torch.float32, **kw)


def test_plan_of_another_config_is_refused():
    cfg = SMALL_MLA
    x, attn = _one_rank_step(cfg)
    other = TwoStageAttention(
        AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.3),
        DCPLayout(),
        dtype=torch.float32,
    )
    plan = other.plan(x.query_start_loc, x.seq_lens, x.block_table)
    with pytest.raises(ValueError, match=r"with this config .*scale=0.2, fused=False, context_pass='split'\), got "
                                         r".*scale=0.3, fused=False, context_pass='split'$"):
        attn(x.q, x.k, None, x.k_cache, None, plan)
    # another instance with the same config may share the plan (one plan per step for all layers)
    twin = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32)
    mine = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    torch.testing.assert_close(twin(x.q, x.k, None, x.k_cache, None, mine), attn(x.q, x.k, None, x.k_cache, None, mine))


def test_capture_limits_need_a_backend_with_fixed_buffers():
    # The reference backend reads the plan's own tensors: a graph replayed after
    # another plan would silently use the captured step's indices. Refused, by name.
    cfg = SMALL_MLA
    limits = dict(max_batch_size=4, max_tokens=16, max_pages=16)
    for backend in ("auto", "reference"):
        with pytest.raises(ValueError, match=r"reference: keeps no metadata in fixed buffers, so capture limits"):
            TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, backend=backend, **limits)
    # Some of the three without the others would silently give no fixed buffers: refused.
    with pytest.raises(ValueError, match=r"all given or none, got max_batch_size, max_tokens without max_pages"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, max_batch_size=4, max_tokens=16)
    with pytest.raises(ValueError, match=r"all given or none, got max_q_len without max_batch_size, max_tokens, max_"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, max_q_len=2)


def test_no_float64_layer():
    # The reference computes in float32: a float64 layer would silently be float32-accurate.
    cfg = SMALL_MLA
    with pytest.raises(ValueError, match=r"reference: dtype torch.float64 not in"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float64)


def test_num_pages_must_be_a_positive_int():
    cfg = SMALL_MLA
    x, attn = _one_rank_step(cfg)
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match=r"num_pages to be an int >= 1, got"):
            attn.plan(x.query_start_loc, x.seq_lens, x.block_table, num_pages=bad)
    attn.plan(x.query_start_loc, x.seq_lens, x.block_table, num_pages=x.k_cache.shape[0])


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's values on the host (a sync on CUDA, refused in capture)."""

    SYNCS = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.masked_select.default}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        index = args[1] if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) else ()
        if func in self.SYNCS or any(i is not None and i.dtype == torch.bool for i in index):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("fmt", ["mla", "gqa"])
def test_a_layer_call_reads_nothing_on_the_host(fmt, tree):
    # The docs promise a layer call capturable in a CUDA graph: no op may read values on the host.
    # The reference backend's grouped passes (also every backend's dense tree fallback) once picked
    # their rows out with boolean masks, a nonzero each.
    step, x, attn, plan = _mixed_step(fmt, tree)
    with _HostSyncs() as mode:
        out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, plan)
    assert mode.seen == [] and torch.isfinite(out).all()
    ref, _ = synthetic.oracle(step, attn.config.scale)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _mixed_step(fmt: str, tree: bool):
    mla = fmt == "mla"
    cfg = AttentionConfig(4, 24, 16, 4, 0.2, 1 if mla else 2, fmt)
    step = synthetic.make_step([0, 3, 9, 17], [2, 5, 1, 3], heads=4, head_dim=24, head_dim_v=16,
                               kv_heads=cfg.num_kv_heads, mla=mla, tree=tree, dtype=torch.float32, seed=3)  # fmt: skip
    x = synthetic.rank_inputs(step, DCPLayout(), 4, mla=mla, dtype=torch.float32, device="cpu", seed=3)
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32)
    return step, x, attn, attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)


def test_a_pass_given_more_rows_than_the_plan_is_refused():
    # The dense passes write padding into a spare row T = plan.num_tokens; a q of more rows would
    # have that row be a real one.
    _, x, attn, plan = _mixed_step("mla", True)
    q = torch.cat([x.q, x.q[:1]])
    with pytest.raises(ValueError, match=r"expected q with T = plan.num_tokens = 11 rows, got \(12, 4, 24\)"):
        attn.backend.query(q, torch.cat([x.k, x.k[:1]]), torch.cat([x.k, x.k[:1]])[..., :16], plan)


def test_a_missing_tensor_names_the_shape_expected():
    cfg = AttentionConfig.mla(num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=4, scale=0.1)
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, device="cpu", backend="reference")
    i32 = dict(dtype=torch.int32)
    plan = attn.plan(torch.tensor([0, 2], **i32), torch.tensor([5], **i32), torch.tensor([[0, 1]], **i32))
    q, k = torch.randn(2, 2, 24), torch.randn(2, 1, 24)
    with pytest.raises(ValueError, match=r"expected k_cache to be a tensor of shape \(\*, 4, 1, 24\), got NoneType"):
        attn(q, k, None, None, None, plan)


def test_call_errors_name_the_tensor():
    # One rank's mistakes that the group-wide test leaves out: each a ValueError naming the tensor.
    _, x, attn, plan = _mixed_step("mla", False)
    for args, match in (
        ((x.q, x.k, None, x.k_cache, x.k_cache[..., :16]), "v=None and v_cache=None for MLA"),
        ((x.q, x.k, None, x.k_cache[..., None], None), r"k_cache.shape == \(\*, 4, 1, 24\)"),
        ((x.q.to("meta"), x.k, None, x.k_cache, None), "expected q on cpu, got meta"),
    ):
        with pytest.raises(ValueError, match=match):
            attn(*args, plan)
    _, x, attn, plan = _mixed_step("gqa", False)
    p = x.v_cache.shape[0]
    with pytest.raises(ValueError, match=r"v.shape == \(11, 2, 16\)"):
        attn(x.q, x.k, x.v[:, :1], x.k_cache, x.v_cache, plan)
    for bad in (x.v_cache[..., :1, :], x.v_cache[:1]):
        with pytest.raises(ValueError, match=re.escape(f"v_cache.shape == {(p, 4, 2, 16)}, got {tuple(bad.shape)}")):
            attn(x.q, x.k, x.v, x.k_cache, bad, plan)


def _combine_used(rank: int, world: int) -> list[str]:
    used = []
    a2a, ag_rs = comm.exchange_a2a, comm.combine_ag_rs
    comm.exchange_a2a = lambda *a, **k: used.append("a2a") or a2a(*a, **k)
    comm.combine_ag_rs = lambda *a, **k: used.append("ag_rs") or ag_rs(*a, **k)
    layout = DCPLayout(world, rank, 2)
    cfg = SMALL_MLA
    step = synthetic.make_step([5], [2], heads=2 * world, head_dim=24, head_dim_v=16, seed=1)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu")
    for combine in ("a2a", "ag_rs"):
        attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, combine=combine, dtype=torch.float32)
        attn(x.q, x.k, None, x.k_cache, None, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
    return used


def test_combine_picks_its_collective():
    # Both combines give the same numbers, so only the collective they run tells them apart.
    assert run_ranks(2, _combine_used) == [["a2a", "ag_rs"]] * 2


# two requests with context and no new tokens: query_start_loc, seq_lens, block_table
I32 = dict(dtype=torch.int32)
NO_TOKENS = (torch.zeros(3, **I32), torch.tensor([3, 5], **I32), torch.zeros(2, 2, **I32))


def test_a_step_with_no_tokens_returns_what_the_call_promises():
    attn = TwoStageAttention(SMALL_MLA, DCPLayout(), dtype=torch.bfloat16)
    plan = attn.plan(*NO_TOKENS)
    bf = dict(dtype=torch.bfloat16)
    q, k, cache = torch.zeros(0, 2, 24, **bf), torch.zeros(0, 1, 24, **bf), torch.zeros(2, 4, 1, 24, **bf)
    out = attn(q, k, None, cache, None, plan)
    assert isinstance(out, torch.Tensor) and out.shape == (0, 2, 16) and out.dtype == torch.bfloat16
    o, lse = attn(q, k, None, cache, None, plan, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (0, 2) and lse.dtype == torch.float32


def _no_token_step(rank: int, world: int) -> list[str]:
    calls = []
    for name in ("gather_queries", "exchange_a2a", "combine_ag_rs"):
        real = getattr(comm, name)
        setattr(comm, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    for combine in ("a2a", "ag_rs"):
        attn = TwoStageAttention(SMALL_MLA, DCPLayout(world, rank, 2), group=dist.group.WORLD, combine=combine,
                                 dtype=torch.float32)  # fmt: skip
        out = attn(torch.zeros(0, 2, 24), torch.zeros(0, 1, 24), None, torch.zeros(2, 4, 1, 24), None,
                   attn.plan(*NO_TOKENS))  # fmt: skip
        assert out.shape == (0, 2, 16)
    return calls


def test_a_step_with_no_tokens_runs_no_collective():
    # docs/api.md: every rank has the step's T, so all return before the all-gather and none waits.
    assert run_ranks(2, _no_token_step) == [[], []]


def _layers_differing_in(rank: int, world: int, what: str) -> str:
    dtype = (torch.float32, torch.bfloat16)[rank % 2] if what == "dtype" else torch.float32
    interleave = 1 + rank % 2 if what == "interleave" else 1
    try:
        TwoStageAttention(SMALL_MLA, DCPLayout(world, rank, interleave), group=dist.group.WORLD, dtype=dtype)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["dtype", "interleave"])
def test_layers_that_differ_in_dtype_or_interleave_are_refused_on_every_rank(what):
    # docs/api.md: the ranks agree on "a digest of its config, world size, interleave, combine and dtype".
    for message in run_ranks(2, _layers_differing_in, what):
        assert re.search(r"same layer on every rank of the DCP group .*got different ones on ranks \[0\] vs \[1\]",
                         message), message  # fmt: skip


def _last_of_three_differs(rank: int, world: int) -> list[str]:
    layout, last = DCPLayout(world, rank, 2), rank == world - 1
    step = synthetic.make_step([5, 9], [2, 3], heads=2 * world, head_dim=24, head_dim_v=16, seed=1)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu")
    said = []

    def expect(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            said.append("no error")
        except ValueError as e:
            said.append(str(e))

    expect(TwoStageAttention, replace(SMALL_MLA, scale=0.3 if last else 0.2), layout, group=dist.group.WORLD,
           dtype=torch.float32)  # fmt: skip
    attn = TwoStageAttention(SMALL_MLA, layout, group=dist.group.WORLD, dtype=torch.float32)
    tree = torch.tensor([-1, 0, -1, 0, 1])
    expect(attn.plan, x.query_start_loc, x.seq_lens, x.block_table, parents=tree if last else None)
    return said


def test_a_difference_on_the_third_rank_is_refused_on_every_rank():
    # Every rank's row is compared, not only ranks 0 and 1.
    for said in run_ranks(3, _last_of_three_differs):
        assert "same layer on every rank" in said[0] and "ranks [0, 1] vs [2]" in said[0], said
        assert "same query_start_loc, seq_lens and parents" in said[1] and "ranks [0, 1] vs [2]" in said[1], said


def test_a_gqa_v_cache_not_of_stride_1_is_refused():
    cfg = AttentionConfig(4, 16, 8, 4, 0.25, num_kv_heads=2, kv_format="gqa")
    step = synthetic.make_step([5, 9], [2, 3], heads=4, head_dim=16, head_dim_v=8, kv_heads=2, mla=False, seed=2)
    x = synthetic.rank_inputs(step, DCPLayout(), 4, mla=False, dtype=torch.float32, device="cpu")
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32)
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    with pytest.raises(ValueError, match=r"expected v_cache with stride 1 in its last dim, got strides \("):
        attn(x.q, x.k, x.v, x.k_cache, strided_last(x.v_cache), plan)


def test_context_pass_errors():
    cfg = SMALL_MLA
    with pytest.raises(ValueError, match=r"expected context_pass in \('split', 'expand', 'auto'\), got 'fast'"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, context_pass="fast")
    limits = dict(max_batch_size=4, max_tokens=16, max_pages=16)
    with pytest.raises(ValueError, match=r"expected context_pass 'split' or 'auto' with capture limits .*got 'expand'"):
        TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32, context_pass="expand", **limits)
    x, attn = _one_rank_step(cfg, tree=True, context_pass="expand")
    with pytest.raises(ValueError, match=r"expected no tree parents with context_pass='expand'"):
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    # A plan of an expanding layer is refused by a splitting one (its caller may not have cached the new tokens).
    x, attn = _one_rank_step(cfg, context_pass="expand")
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    split = TwoStageAttention(cfg, DCPLayout(), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"context_pass='split'\), got .*context_pass='expand'$"):
        split(x.q, x.k, None, x.k_cache, None, plan)


def test_auto_splits_where_the_backend_prefers_it_and_on_tree_steps():
    x, attn = _one_rank_step(SMALL_MLA, context_pass="auto")  # the reference never prefers the expansion
    assert attn.plan(x.query_start_loc, x.seq_lens, x.block_table).context_plan is None
    attn.backend.prefers_expanded_context = lambda plan: True
    assert attn.plan(x.query_start_loc, x.seq_lens, x.block_table).context_plan is not None
    x, attn = _one_rank_step(SMALL_MLA, context_pass="auto", tree=True)
    attn.backend.prefers_expanded_context = lambda plan: True
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table, parents=x.parents)
    assert plan.context_plan is None  # a tree's token does not see every earlier one: split


def test_the_expanded_pass_reads_the_new_tokens_from_the_cache():
    # Request 0 (C = 5) has 2 new tokens, request 1 (C = 9) 3. Its contract: the caller caches them first.
    cfg = SMALL_MLA
    x, attn = _one_rank_step(cfg, context_pass="expand")
    plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    good = attn(x.q, x.k, None, x.k_cache, None, plan)
    split_x, split = _one_rank_step(cfg)
    torch.testing.assert_close(good, split(x.q, x.k, None, x.k_cache, None, split.plan(x.query_start_loc,
                               x.seq_lens, x.block_table)), atol=1e-5, rtol=1e-5)  # fmt: skip
    stale = x.k.clone()
    stale[2] += 1.0  # request 1's first new token, as if the cache held another step's key there
    plan.write_new_tokens(x.k_cache, stale)
    out = attn(x.q, x.k, None, x.k_cache, None, plan)
    changed = (out - good).abs().amax(dim=(1, 2)) > 1e-4
    assert changed.tolist() == [False, False, True, True, True]  # the tokens that see it, and no other
    plan.write_new_tokens(x.k_cache, x.k)
    torch.testing.assert_close(attn(x.q, x.k, None, x.k_cache, None, plan), good)


def _expansion_on_one_rank(rank: int, world: int) -> str:
    cfg = SMALL_MLA
    layout = DCPLayout(world, rank, 1)
    step = synthetic.make_step([5, 9], [2, 3], heads=2 * world, head_dim=24, head_dim_v=16, seed=1)
    x = synthetic.rank_inputs(step, layout, 4, mla=True, dtype=torch.float32, device="cpu", seed=1)
    attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, dtype=torch.float32, context_pass="auto")
    if rank == 0:  # as if rank 0's backend preferred the expansion and rank 1's did not
        attn.backend.prefers_expanded_context = lambda plan: True
    try:
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_expand_differently_are_refused_on_every_rank():
    for msg in run_ranks(2, _expansion_on_one_rank):
        assert msg.startswith("expected the same context pass on every rank of the DCP group, got the expanded one "
                              "on ranks [0] only"), msg
