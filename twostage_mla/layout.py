"""Where each token of a request lives under Decode Context Parallelism.

A request's KV positions are dealt to the N ranks of the DCP group in runs of
I tokens (the interleave): position p lives on rank ``(p // I) % N`` at local
slot ``(p // (N*I)) * I + p % I``. Worked example, N = 2, I = 2::

    position p     0 1 2 3 4 5 6 7 8
    owner(p)       0 0 1 1 0 0 1 1 0
    local_index(p) 0 1 0 1 2 3 2 3 4

    local_len(9, 0) = 5  (positions 0 1 4 5 8),  local_len(9, 1) = 4

Every function here works elementwise on integer tensors (or Python ints) and
needs no host synchronisation, except kv_slots' checks of its values
(``check=True``, its default). Their int arguments (N, I, rank, page size, and
a length or position given as an int) are checked; a tensor's values are not.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

IntLike = int | torch.Tensor


def _int_arg(name: str, v: Any, low: int) -> int:
    """``v`` as a Python int (NumPy ints too), or a ValueError naming ``name``; bool is an int never meant as one."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"expected {name} to be an int >= {low}, got {v!r}")
    return int(v)


def _layout_ints(world_size: Any, rank: Any, interleave: Any) -> tuple[int, int, int]:
    """(N, r, I) as Python ints, or a ValueError naming the bad one (N, I >= 1, 0 <= r < N)."""
    n, r, i = _int_arg("world_size", world_size, 1), _int_arg("rank", rank, 0), _int_arg("interleave", interleave, 1)
    if r >= n:
        raise ValueError(f"expected 0 <= rank < world_size = {n}, got rank={r!r}")
    return n, r, i


@dataclass(frozen=True)
class DCPLayout:
    """How positions are spread over a DCP group.

    world_size: N, ranks in the DCP group (1 = no sharding).
    rank: r, this process's rank inside the group, 0 <= r < N.
    interleave: I, consecutive positions kept together on one rank.
    """

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        n, r, i = _layout_ints(self.world_size, self.rank, self.interleave)
        for name, v in (("world_size", n), ("rank", r), ("interleave", i)):
            object.__setattr__(self, name, v)


def _int_tensor(name: str, x: Any, dim: int) -> torch.Tensor:
    # Signed only: an unsigned table would wrap the -1 of unused entries (uint8: page 255).
    bad = not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.is_complex() or not x.dtype.is_signed
    if bad or x.dim() != dim:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected {name} to be a {dim}-D signed integer tensor, got {got}")
    return x


def _check_page_size(page_size: Any, layout: DCPLayout) -> None:
    """Raise unless page_size is a positive int and a multiple of the layout's interleave."""
    bad = isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral)
    if bad or page_size < 1 or page_size % layout.interleave:
        raise ValueError(
            f"expected page_size to be a positive multiple of interleave = {layout.interleave}, got {page_size!r}"
        )


def _check_args(name: str, x: Any, world_size: Any, interleave: Any, rank: Any = 0) -> None:
    """Raise unless N, I >= 1, 0 <= rank < N, and ``x`` (named ``name``) is an int >= 0 or an integer tensor."""
    _layout_ints(world_size, rank, interleave)  # DCPLayout's checks, without building one (plan() calls this often)
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"expected {name} to be an int or an integer tensor, got a {x.dtype} tensor")
    else:
        _int_arg(name, x, 0)


def owner(p: IntLike, world_size: int, interleave: int) -> IntLike:
    """Rank that stores position ``p``: ``(p // I) % N``.

    p: an int >= 0, or an integer tensor of any shape (elementwise; same shape and dtype back).
    """
    _check_args("p", p, world_size, interleave)
    return (p // interleave) % world_size


def local_index(p: IntLike, world_size: int, interleave: int) -> IntLike:
    """Slot of position ``p`` in its owner's shard: ``(p // (N*I)) * I + p % I``.

    p: an int >= 0, or an integer tensor of any shape (elementwise; same shape and dtype back).
    """
    _check_args("p", p, world_size, interleave)
    return (p // (world_size * interleave)) * interleave + p % interleave


def local_len(length: IntLike, world_size: int, interleave: int, rank: int) -> IntLike:
    """How many of the positions ``0 .. length-1`` rank ``rank`` stores.

    ``(L // (N*I)) * I + clamp(L - (L // (N*I)) * N*I - r*I, 0, I)``; e.g. with
    N = 2, I = 2: local_len(9, ., 0) = 5 and local_len(9, ., 1) = 4.
    length: an int >= 0, or an integer tensor of any shape (elementwise; same shape and dtype back).
    rank: 0 <= rank < world_size.
    """
    _check_args("length", length, world_size, interleave, rank)
    stride = world_size * interleave
    full = length // stride
    rest = length - full * stride - rank * interleave
    if isinstance(rest, torch.Tensor):
        rest = rest.clamp(0, interleave)
    else:
        rest = min(max(rest, 0), interleave)
    return full * interleave + rest


def local_pages(length: IntLike, world_size: int, interleave: int, rank: int, page_size: int) -> IntLike:
    """Pages rank ``rank`` needs for a request of ``length`` tokens: ceil(local_len / page_size).

    length: an int >= 0, or an integer tensor of any shape (elementwise; same shape and dtype back).
    page_size: an int >= 1.

    Rank 0 needs the most of any rank, which is why block tables and capture
    limits are sized and checked against ``rank=0`` on every rank.
    """
    _int_arg("page_size", page_size, 1)
    return -(-local_len(length, world_size, interleave, rank) // page_size)


def kv_slots(
    positions: torch.Tensor,
    request: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    layout: DCPLayout,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Flat cache slot of each position on this rank, or -1 where another rank owns it.

    positions: (T,) signed int, position of each token in its request.
    request: (T,) signed int, the request (row of ``block_table``) each token belongs to.
    block_table: (B, max_pages) signed int (int32 as the plan keeps it), this rank's pages per request.
    page_size: a positive multiple of ``layout.interleave``.
    returns: (T,) int64; slot s means ``cache.view(-1, ...)[s]``, i.e. page
        ``s // page_size``, offset ``s % page_size``.
    check: raise unless every position is >= 0, every request a row of the
        table, and the table covers every position this rank owns with a
        page id >= 0 (host syncs); :class:`StepPlan` skips it, as
        :func:`plan_step` checked the table. Unchecked, such a position maps
        to a wrong slot (or to -1 with a table of no columns).

    Use it to write the step's new K/V (or a prefill) into this rank's shard:
    ``keep = slots >= 0; cache.view(-1, H, D)[slots[keep]] = k[keep]`` for a
    contiguous cache, or ``cache[s // page_size, s % page_size] = ...``.
    """
    if not isinstance(layout, DCPLayout):
        raise ValueError(f"expected layout to be a DCPLayout, got {type(layout).__name__}")
    _check_page_size(page_size, layout)
    positions, request = _int_tensor("positions", positions, 1).long(), _int_tensor("request", request, 1)
    _int_tensor("block_table", block_table, 2)
    if request.shape != positions.shape:
        want, got = tuple(positions.shape), tuple(request.shape)
        raise ValueError(f"expected request.shape == positions.shape = {want}, got {got}")
    n, i = layout.world_size, layout.interleave
    if check and positions.numel():  # host syncs
        if int(positions.min()) < 0:
            raise ValueError(f"expected positions >= 0, got {int(positions.min())}")
        lo, hi = int(request.min()), int(request.max())
        if lo < 0 or hi >= block_table.shape[0]:
            raise ValueError(
                f"expected 0 <= request < block_table.shape[0] = {block_table.shape[0]}, got {lo if lo < 0 else hi}"
            )
    li = local_index(positions, n, i)
    mine = owner(positions, n, i) == layout.rank
    if check:  # a host sync
        past = (li // page_size >= block_table.shape[1]) & mine
        if bool(past.any()):
            t = int(past.nonzero()[0])
            raise ValueError(
                f"expected block_table with at least {int(li[t]) // page_size + 1} pages per request, got "
                f"{block_table.shape[1]}: position {int(positions[t])} is this rank's local slot {int(li[t])}"
            )
    if block_table.shape[1] == 0:  # this rank holds nothing of these requests
        return torch.full_like(positions, -1)
    # Positions owned elsewhere can index past this rank's table: clamp, then mask.
    col = (li // page_size).clamp(max=block_table.shape[1] - 1)
    page = block_table.long()[request.long(), col]
    padding = mine & (page < 0)  # a padding entry: its slot would wrap onto a live page
    if check and bool(padding.any()):
        t = int(padding.nonzero()[0])
        raise ValueError(
            f"expected a page id >= 0 in block_table[{int(request[t])}, {int(col[t])}] for position "
            f"{int(positions[t])}, which this rank owns, got {int(page[t])}"
        )
    slots = page * page_size + li % page_size
    return torch.where(mine, slots, torch.full_like(slots, -1))
