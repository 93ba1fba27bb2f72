"""Random decode steps with known answers, for the demo, the benchmarks and tests.

Every rank builds the same step from the same seed, then its own shard, so
no data has to be sent around to check a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twostage_mla.cache import build_shard
from twostage_mla.layout import DCPLayout
from twostage_mla.oracle import oracle_attention


@dataclass(frozen=True)
class SyntheticStep:
    """A batch of requests with their whole K/V (CPU tensors).

    q: (T, H_total, D) every rank's heads, rank-major.
    kv: (S, H_kv, D) keys of every request's positions, requests concatenated;
        v: (S, H_kv, Dv) (for MLA the first Dv values of kv).
    query_start_loc: (B+1,) int32; seq_lens: (B,) int32 including new tokens.
    new_token_rows: (T,) int64, row of kv / v holding each query's own K/V.
    parents: (T,) int64 tree parents within a request, or None (causal chain).
    """

    q: torch.Tensor
    kv: torch.Tensor
    v: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    new_token_rows: torch.Tensor
    parents: torch.Tensor | None = None


def make_step(
    context_lens: list[int],
    q_lens: list[int],
    *,
    heads: int,
    head_dim: int,
    head_dim_v: int,
    kv_heads: int = 1,
    mla: bool = True,
    tree: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> SyntheticStep:
    """Random step; ``heads`` counts the heads of all ranks together.

    tree: draw random tree parents (each token's parent any earlier token of
        its request, or -1) instead of a causal chain.
    dtype: values are rounded to it (kept as float32), so the oracle sees
        exactly what a layer running in ``dtype`` sees.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).float()

    seq = [c + q for c, q in zip(context_lens, q_lens)]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()), dtype=torch.int32)
    t, s = int(qsl[-1]), sum(seq)
    q = randn(t, heads, head_dim)
    kv = randn(s, kv_heads, head_dim)
    v = kv[..., :head_dim_v] if mla else randn(s, kv_heads, head_dim_v)
    starts = [0]
    for n in seq[:-1]:
        starts.append(starts[-1] + n)
    rows = (
        torch.cat([torch.arange(st + c, st + c + q_) for st, c, q_ in zip(starts, context_lens, q_lens)])
        if t
        else torch.zeros(0, dtype=torch.long)
    )
    parents = None
    if tree:
        # Token j's parent: any earlier token of its request, or -1 (a root).
        offsets = torch.cat([torch.arange(q_) for q_ in q_lens]) if t else torch.zeros(0, dtype=torch.long)
        parents = (torch.rand(t, generator=g) * (offsets + 1)).long() - 1
    return SyntheticStep(q, kv, v, qsl, torch.tensor(seq, dtype=torch.int32), rows, parents)


def oracle(step: SyntheticStep, scale: float, heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (o (T, h, Dv), lse (T, h)) of the step for the query heads ``heads``.

    Pass one rank's slice for GQA: each rank's heads read the group's KV heads
    with the grouping of that rank (head h -> KV head h // (H / H_kv)).
    """
    q = step.q[:, heads]
    return oracle_attention(q, step.kv, step.v, step.query_start_loc, step.seq_lens, scale, step.parents)


@dataclass(frozen=True)
class RankInputs:
    """What one rank feeds the layer, cast and moved to its device."""

    q: torch.Tensor  # (T, H, D) this rank's heads
    k: torch.Tensor  # (T, H_kv, D) fresh keys of the step
    v: torch.Tensor | None  # (T, H_kv, Dv) or None for MLA
    k_cache: torch.Tensor  # (P, page_size, H_kv, D)
    v_cache: torch.Tensor | None
    block_table: torch.Tensor  # (B, max_pages) int32
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    parents: torch.Tensor | None


def rank_inputs(
    step: SyntheticStep,
    layout: DCPLayout,
    page_size: int,
    *,
    mla: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    fill: float | None = None,
) -> RankInputs:
    """Slice this rank's heads and build its shard (pages in random order).

    The shard also holds the step's new tokens, as an engine that writes the
    cache before attention would: the context pass must not read them.
    fill: value of unwritten cache slots (None: noise; NaN: like torch.empty).
    """
    h = step.q.shape[1] // layout.world_size
    g = torch.Generator().manual_seed(seed + 7919 * layout.rank)
    k_cache, bt = build_shard(step.kv, step.seq_lens, layout, page_size, extra_pages=2, generator=g, fill=fill)
    v_cache = None
    if not mla:
        v_cache, bt_v = build_shard(
            step.v,
            step.seq_lens,
            layout,
            page_size,
            extra_pages=2,
            generator=torch.Generator().manual_seed(seed + 7919 * layout.rank),
            fill=fill,
        )
        assert torch.equal(bt, bt_v)
    rows = step.new_token_rows

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device=device, dtype=dtype)

    return RankInputs(
        q=cast(step.q[:, layout.rank * h : (layout.rank + 1) * h]),
        k=cast(step.kv[rows]),
        v=None if mla else cast(step.v[rows]),
        k_cache=cast(k_cache),
        v_cache=cast(v_cache),
        block_table=bt.to(device),
        query_start_loc=step.query_start_loc.to(device),
        seq_lens=step.seq_lens.to(device),
        parents=None if step.parents is None else step.parents.to(device),
    )
