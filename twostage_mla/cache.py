"""Building a rank's paged shard of the KV cache from unsharded K/V.

Engines write their caches themselves (with :meth:`StepPlan.write_new_tokens`);
this helper builds one from whole sequences, for prefill, tests and the demo.
"""

from __future__ import annotations

import numbers

import torch

from twostage_mla.layout import DCPLayout, _check_page_size, _int_arg, _int_tensor, kv_slots, local_pages


def build_shard(
    kv: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: DCPLayout,
    page_size: int,
    *,
    extra_pages: int = 0,
    generator: torch.Generator | None = None,
    fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``layout.rank``'s paged cache holding its positions of every request.

    kv: (S, H_kv, D) requests' positions 0 .. seq_lens[b]-1 concatenated.
    seq_lens: (B,) int.
    extra_pages: unused pages to add.
    generator: a CPU torch.Generator; if given, pages are handed out in a random order.
    fill: value of every slot no position is written to (None: random
        noise), so a kernel that reads past a request's length shows up;
        NaN imitates an engine's uninitialised cache.
    returns cache (P, page_size, H_kv, D) kv.dtype, block_table (B, max_pages) int32
    (the same width on every rank; unused entries -1, so that a write through one
    is refused rather than landing on a live page).
    """
    if not isinstance(layout, DCPLayout):
        raise ValueError(f"expected layout to be a DCPLayout, got {type(layout).__name__}")
    sl = _int_tensor("seq_lens", seq_lens, 1).tolist()
    if any(s < 0 for s in sl):
        raise ValueError(f"expected seq_lens >= 0, got {sl}")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or kv.shape[0] != sum(sl):
        got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"expected kv: (S = seq_lens.sum() = {sum(sl)}, H_kv, D), got {got}")
    if not kv.is_floating_point() or kv.device.type == "meta":
        raise ValueError(f"expected kv: a floating-point tensor with values, got {kv.dtype} on {kv.device}")
    _check_page_size(page_size, layout)
    if generator is not None and not (isinstance(generator, torch.Generator) and generator.device.type == "cpu"):
        raise ValueError(f"expected generator to be a CPU torch.Generator or None, got {generator!r}")
    if fill is not None and (isinstance(fill, bool) or not isinstance(fill, numbers.Real)):
        raise ValueError(f"expected fill to be a real number or None, got {fill!r}")
    extra_pages = _int_arg("extra_pages", extra_pages, 0)
    n, r, i = layout.world_size, layout.rank, layout.interleave
    pages = [local_pages(s, n, i, r, page_size) for s in sl]
    # Every rank's table is as wide as rank 0 needs (the most), as plan_step asks.
    width = max(max((local_pages(s, n, i, 0, page_size) for s in sl), default=0), 1)
    total = max(sum(pages) + extra_pages, 1)  # a kernel needs at least one page to point at
    order = torch.randperm(total, generator=generator) if generator is not None else torch.arange(total)
    block_table = torch.full((len(sl), width), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        block_table[b, :p] = order[used : used + p].to(torch.int32)
        used += p
    shape = (total * page_size, *kv.shape[1:])
    if fill is None:
        cache = torch.randn(shape, generator=generator, dtype=torch.float32).to(kv.dtype)
    else:
        cache = torch.full(shape, fill, dtype=kv.dtype)
    positions = torch.cat([torch.arange(s) for s in sl]) if sl else torch.zeros(0, dtype=torch.long)
    request = torch.repeat_interleave(torch.arange(len(sl)), torch.tensor(sl, dtype=torch.long))
    slots = kv_slots(positions, request, block_table, page_size, layout)
    keep = slots >= 0
    cache[slots[keep]] = kv.cpu()[keep]
    return cache.view(total, page_size, *kv.shape[1:]).to(kv.device), block_table.to(kv.device)
