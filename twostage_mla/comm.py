"""Cross-rank communication of the DCP group: gather queries, combine states.

The process group is always passed in; N and this rank are the group's.
The collectives compare nothing across ranks (no communication beyond
themselves): every rank passes the same T, heads and dtype, as the layer does
once plan() agreed on the step; ``agree`` is that agreement (a host sync, for
setup and plans). Head order on the wire is rank-major:
rank s's local heads are heads s*H .. s*H+H-1 of the gathered tensor, so a
split over heads hands every rank back its own. Every function but ``agree``
and ``digest`` (plan-time helpers) is free of host synchronisation (usable
under CUDA graph capture).
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange

from twostage_mla.state import lse_weights, merge_states

COMBINE_METHODS = ("a2a", "ag_rs")

# torch >= 2.12 renamed these; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


AGREE_KINDS = ("layer", "step")  # what the ranks agree on: a layer when built, a step when planned


def digest(*parts: Any) -> int:
    """A signed 64-bit digest of parts (tensors by their int64 values, the rest by repr).

    The ranks compare digests of the step and the layer in one small all-reduce instead of the
    whole tensors; unlike a sum, no likely difference between ranks maps to the same value.
    """
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, torch.Tensor):
            # The tensor's own bytes (what .numpy().tobytes() gives), read without NumPy, which torch
            # does not install: a bare `pip install twostage-mla` has none.
            t = p.detach().long().cpu().contiguous()
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little", signed=True)


def agree(kind: str, row: list[int], group: dist.ProcessGroup, device: torch.device | str | None) -> list[list[int]]:
    """Every rank's ``row`` (up to 5 int64s) in one all-reduce; a host sync, for setup and plans only.

    kind: one of AGREE_KINDS. Where ranks agree on different kinds (one builds a layer while another
        plans a step), every rank raises rather than read another collective's numbers.
    device: the layer's device, or what it was given (None, or anything, where its setup was
        refused): the all-reduce runs on the CPU unless the group is NCCL's, then on the GPU the
        group is bound to, else on that device where it names a GPU of this machine, else on the
        current one: the same rule on every rank, and one that cannot fail on a refusing rank.
    returns N rows, row r = rank r's.
    """
    if kind not in AGREE_KINDS or len(row) > 5:
        raise ValueError(f"expected kind in {AGREE_KINDS} and a row of up to 5 ints, got {kind!r}, {row!r}")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    dev = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        dev = getattr(group, "bound_device_id", None)
        if dev is None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                dev = None
        if dev is None or dev.type != "cuda" or dev.index is None or dev.index >= torch.cuda.device_count():
            dev = torch.device("cuda", torch.cuda.current_device())
    rows = torch.zeros(n, 6, dtype=torch.int64, device=dev)
    rows[r, 0] = AGREE_KINDS.index(kind) + 1
    rows[r, 1 : 1 + len(row)] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(rows, group=group)
    out = rows.tolist()
    kinds = {AGREE_KINDS[k - 1] for k, *_ in out}
    if len(kinds) > 1:
        raise ValueError(
            "expected every rank of the DCP group to build its layers and plan its steps in the same order, got "
            f"ranks {differing([[k] for k, *_ in out])} at different ones (1 = a layer built, 2 = a step planned: "
            f"{[k for k, *_ in out]})"
        )
    return [row_[1 : 1 + len(row)] for row_ in out]


def differing(rows: list[list[int]]) -> str:
    """The ranks grouped by equal rows, for an error message: '[0] vs [1, 2, 3]'."""
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(r)
    return " vs ".join(str(ranks) for ranks in groups.values())


def _check_states(o: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup) -> int:
    """N, the group's size, after checking o: (N, T, H, Dv) and lse: (N, T, H) against it (no communication)."""
    n = dist.get_world_size(group)
    if o.dim() != 4 or o.shape[0] != n or lse.shape != o.shape[:3]:
        raise ValueError(
            f"expected o: (N = {n}, T, H, Dv) and lse: (N, T, H) = o.shape[:3], got o {tuple(o.shape)} and "
            f"lse {tuple(lse.shape)}"
        )
    return n


def gather_queries(q: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Start the all-gather of every rank's queries.

    q: (T, H, D) any dtype, this rank's heads.
    returns (buffer, work): after ``work.wait()`` buffer is (N, T, H, D) in
    q's dtype, rank-major; overlap independent work (the query pass) before waiting.
    """
    n = dist.get_world_size(group)
    # Gathered flat along dim 0 (gloo insists), viewed as (N, T, ...) after.
    out = q.new_empty((n * q.shape[0], *q.shape[1:]))
    work = _all_gather(out, q.contiguous(), group=group, async_op=True)
    return out.view(n, *q.shape), work


def exchange_a2a(o: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-to-all of (o, lse) by head slice: every rank gets N states of its heads.

    o: (N, T, H, Dv) any float dtype: slice n holds rank n's heads, as this
        rank computed them over its shard.
    lse: (N, T, H) float32.
    returns o (N, T, H, Dv) o.dtype and lse (N, T, H) float32, slice n = from
    rank n's shard; views into one receive buffer.
    """
    n = _check_states(o, lse, group)
    if o[0].numel() == 0:  # no rows (T = 0): nothing to send; every rank of the group has the same T
        return o.new_zeros(o.shape), lse.new_zeros(lse.shape, dtype=torch.float32)
    # o and lse travel as raw bytes in one collective; both segments are padded
    # to 16 bytes so every row can be viewed back as o's dtype and as float32.
    o_bytes = o[0].numel() * o.element_size()
    o_pad = -(-o_bytes // 16) * 16
    lse_pad = -(-lse[0].numel() * 4 // 16) * 16
    send = o.new_empty((n, o_pad + lse_pad), dtype=torch.uint8)
    # contiguous(): a (N, T, 1)-shaped slice can reshape to a strided view, which cannot change dtype.
    send[:, :o_bytes] = o.reshape(n, -1).contiguous().view(torch.uint8)
    send[:, o_pad : o_pad + lse[0].numel() * 4] = lse.float().reshape(n, -1).contiguous().view(torch.uint8)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    lse_recv = recv[:, o_pad : o_pad + lse[0].numel() * 4].view(torch.float32).view(lse.shape)
    return recv[:, :o_bytes].view(o.dtype).view(o.shape), lse_recv


def combine_a2a(
    o: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-to-all of (o, lse) by head slice, then a local merge of N states.

    o: (N, T, H, Dv), lse: (N, T, H) float32, as for :func:`exchange_a2a`.
    returns o (T, H, Dv) float32, lse (T, H) float32 over all ranks' shards.
    (The layer calls exchange_a2a itself and fuses the merge with the query pass.)
    """
    return merge_states(*exchange_a2a(o, lse, group), out_dtype=torch.float32)


def combine_ag_rs(
    o: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather lse, rescale, reduce-scatter over heads (the engines' "ag_rs").

    o: (N, T, H, Dv) any float dtype, slice n = rank n's heads; lse: (N, T, H) float32.
    returns o (T, H, Dv) float32, lse (T, H) float32.
    The reduce-scatter sums in float32, so the result does not depend on N's
    rounding order in the compute dtype.
    """
    n, rank = _check_states(o, lse, group), dist.get_rank(group)
    all_lse = lse.new_empty((n * n, *lse.shape[1:]), dtype=torch.float32)
    _all_gather(all_lse, lse.float().contiguous(), group=group)
    all_lse = all_lse.view(n, *lse.shape)  # (src, dst, T, H)
    total, w = lse_weights(all_lse)  # (dst, T, H), (src, dst, T, H)
    w = w[rank].unsqueeze(-1)  # this rank's own row: its shard's weight for every head
    # An empty state's o may be garbage: left out. A NaN lse reaches the output (not weight 0).
    scaled = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, o.float() * w)
    out = o.new_empty(o.shape[1:], dtype=torch.float32)
    _reduce_scatter(out, scaled.reshape(n * o.shape[1], *o.shape[2:]), group=group)
    return out, total[rank]


def to_rank_major(x: torch.Tensor, world_size: int, num_kv_heads: int) -> torch.Tensor:
    """(T, H_kv*N*G, ...) kv-head-major context output -> (N, T, H_kv*G, ...) by owner rank, same dtype."""
    return rearrange(x, "t (k n g) ... -> n t (k g) ...", k=num_kv_heads, n=world_size)


def from_rank_major(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(N, T, H_kv*G, D) gathered queries -> (T, H_kv*N*G, D), kv-head-major, same dtype.

    Query head h of rank s reads KV head h // G; putting every rank's heads of
    one KV head together keeps the usual GQA rule (head i reads i // (N*G)).
    For MLA (one KV head) this is plain rank-major order.
    """
    return rearrange(x, "n t (k g) d -> t (k n g) d", k=num_kv_heads)
