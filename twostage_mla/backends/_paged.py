"""Plan-time helpers shared by the fast backends: page lists, gather indices, empty rows.

Most run inside ``backend.plan`` (once per step, host sync allowed) and return
device tensors that the per-layer calls only read; read_slots, mask_empty_rows,
empty_state and lse_heads_major run per layer, without host sync (capturable).
Worked example, page_size 4, three requests with local context lengths 6, 0
and 3::

    block_table = [[7, 2, 9], [5, -1, -1], [3, 1, -1]]  local_context_lens = [6, 0, 3]
    pages used  = [2, 0, 1]                             page_indptr = [0, 2, 2, 3]
    page_indices = [7, 2, 3]
    slots (gather) = [28 29 30 31 8 9 | 12 13 14]       key_indptr = [0, 6, 6, 9]
"""

from __future__ import annotations

import math

import torch

from twostage_mla.plan import StepPlan

LN2 = math.log(2.0)  # FlashInfer's prefill kernels return log2; multiply to get natural log


def page_lists(block_table: torch.Tensor, lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR page list of each request's first ``lens[b]`` slots.

    block_table: (B, max_pages) int32; lens: (B,) int on its device.
    returns page_indptr (B+1,) int32, page_indices (max(P_used, 1),) int32.
    The indices hold one extra 0 when no page is used, so kernels that take a
    pointer to them never see an empty tensor (page 0 exists in any cache).
    """
    npages = (lens.long() + page_size - 1) // page_size  # (B,)
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = npages.cumsum(0).to(torch.int32)
    cols = torch.arange(block_table.shape[1], device=lens.device)
    keep = cols[None, :] < npages[:, None]  # (B, max_pages), row-major = request order
    indices = block_table[keep].to(torch.int32)
    if indices.numel() == 0:
        indices = torch.zeros(1, dtype=torch.int32, device=lens.device)
    return indptr, indices


def key_indptr(plan: StepPlan) -> torch.Tensor:
    """(B+1,) int32 cumulative local context lengths (varlen kernels' cu_seqlens_k)."""
    lens = plan.local_context_lens
    indptr = torch.zeros(plan.batch_size + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = lens.cumsum(0)
    return indptr


def last_page_lens(plan: StepPlan) -> torch.Tensor:
    """(B,) int32: tokens in each request's last used local page (0 for a request with none)."""
    lens = plan.local_context_lens.long()
    ps = plan.page_size
    return torch.where(lens > 0, (lens - 1) % ps + 1, 0).to(torch.int32)


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache's entries at flat slots (any shape of index), cache: (P, page_size, ...).

    A flat view where pages and their slots merge (a contiguous cache); else by (page, offset),
    so that a cache strided in pages (a layer's slice of a larger buffer) is not copied whole.
    """
    if cache.stride(0) == cache.shape[1] * cache.stride(1):
        return cache.flatten(0, 1)[slots]
    return cache[slots // cache.shape[1], slots % cache.shape[1]]


def gather_slots(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat cache slots of every request's local context, requests concatenated.

    returns slots (S,) int64 (``read_slots(cache, slots)`` is the contiguous
    local context), key_indptr (B+1,) int32, S (host int).
    For kernels with no paged entry: gathering reads and writes the context
    once more, so it costs about twice the bytes of a paged kernel.
    """
    lens = plan.local_context_lens.long()
    dev = lens.device
    indptr = key_indptr(plan)
    total = int(indptr[-1])  # host sync: fine, this is plan time
    req = torch.repeat_interleave(torch.arange(plan.batch_size, device=dev), lens, output_size=total)
    li = torch.arange(total, device=dev) - indptr.long()[req]
    ps = plan.page_size
    slots = plan.block_table.long()[req, li // ps] * ps + li % ps
    return slots, indptr, total


def empty_context_rows(plan: StepPlan) -> torch.Tensor | None:
    """(T, 1) bool: tokens whose request has no local context; None if there are none.

    Kernels disagree on the state of a row with no keys (docs/design.md, "Conventions");
    backends whose kernel is not known to return (0, -inf) mask these rows.
    """
    empty = (plan.local_context_lens == 0)[plan.token_request]
    if plan.num_tokens == 0 or not bool(empty.any()):  # host sync: plan time
        return None
    return empty[:, None]


def mask_empty_rows(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Set rows with no keys to the empty state (0, -inf), in place.

    o: (T, H, Dv); lse: (T, H) float32; rows: (T, 1) bool or None (nothing to do).
    Graph-capturable (no host sync).
    """
    if rows is not None:
        o.masked_fill_(rows[:, :, None], 0.0)
        lse.masked_fill_(rows, float("-inf"))
    return o, lse


def empty_state(t: int, h: int, dv: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state over no keys: o (t, h, dv) zeros in like's dtype, lse (t, h) -inf float32."""
    o = like.new_zeros((t, h, dv))
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=like.device)
    return o, lse


def lse_heads_major(lse: torch.Tensor, num_tokens: int, num_heads: int) -> torch.Tensor:
    """A varlen kernel's (H, T) lse (FA2/FA3 layout) as (T, H) float32.

    Raises ValueError if the kernel returned another layout (an older
    flash-attn returns (B, H, max_q): say so rather than read it wrongly).
    """
    if lse.shape != (num_heads, num_tokens):
        raise ValueError(
            f"expected kernel lse of shape (H, T) = ({num_heads}, {num_tokens}), got {tuple(lse.shape)}"
        )
    return lse.float().transpose(0, 1).contiguous()  # merge kernels may want row-major

