"""Per-step metadata: built once per decode step, shared by every layer.

All host synchronisation of a step happens at plan time (here, reading lengths
to check them and to size buffers; in the backend's plan; and with N > 1 in the
ranks' agreement), so the per-layer call never has to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from twostage_mla.layout import DCPLayout, _check_page_size, _int_tensor, kv_slots, local_len, local_pages


@dataclass(frozen=True)
class StepPlan:
    """Lengths and indices of one step, for one rank of the DCP group.

    For request b with context C_b and Q_b new tokens (seq_len = C_b + Q_b)::

        position   0 1 2 ......... C_b-1 | C_b ...... C_b+Q_b-1
                   context: sharded cache | new tokens: fresh K/V of this step
                   non-causal pass        | causal pass (or tree mask)

        context_lens[b]       = C_b
        local_context_lens[b] = local_len(C_b, r): slots 0.. of this rank's
                                shard that the context pass reads
        query_start_loc[b]    = first token of request b in q (T tokens in all)

    Tensors live on the device of ``query_start_loc``; ints are host values.
    ``backend_state`` holds kernel plans of the backend named ``backend``.

    Fields (T tokens, B requests, W = block-table width, T_r = tokens of the
    step this rank stores, T_r <= T):
        query_start_loc (B+1,) int32; seq_lens, q_lens, context_lens,
        local_context_lens (B,) int32; block_table (B, W) int32, this rank's
        pages (the caller's table as given: entries past what a request uses
        are never read); token_request, token_offset (T,) int64;
        write_rows, write_slots (T_r,) int64; query_mask (B, max_q_len,
        max_q_len) bool or None (causal); num_tokens, batch_size, max_q_len,
        max_context_len, max_local_context_len, page_size, max_page_id: int.
    """

    layout: DCPLayout
    page_size: int
    num_tokens: int  # T
    batch_size: int  # B
    max_q_len: int
    max_context_len: int
    max_local_context_len: int
    query_start_loc: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    q_lens: torch.Tensor  # (B,) int32
    context_lens: torch.Tensor  # (B,) int32, global C_b
    local_context_lens: torch.Tensor  # (B,) int32, on this rank
    block_table: torch.Tensor  # (B, W) int32, this rank's pages
    token_request: torch.Tensor  # (T,) int64, request of each token
    token_offset: torch.Tensor  # (T,) int64, j: index of the token within its request
    write_rows: torch.Tensor  # (T_r,) int64, tokens of the step this rank stores
    write_slots: torch.Tensor  # (T_r,) int64, their flat slots in this rank's cache
    # (B, max_q_len, max_q_len) bool, [b, j, i]: token j of request b sees fresh key i; None =
    # causal. A fused_plan's (below) is wider: the layer's fixed buffer, causal on causal steps.
    query_mask: torch.Tensor | None = None
    max_page_id: int = -1  # the largest page id the step uses on this rank (-1: none), checked against caches
    backend: str | None = None
    backend_state: Any = None
    spec: Any = None  # the AttentionSpec of the layer that planned it
    # Under capture limits with the fused kernel: (count, n), the planning layer's count of plans
    # written into its fixed buffers ([int], shared) and this plan's number. Only the latest plan's
    # indices are in those buffers.
    fixed_version: Any = None
    # ... and this plan with its per-token indices and mask as views of those buffers: what the
    # kernel reads (a graph replays their addresses). The fields above stay this plan's own.
    fused_plan: Any = None
    made_for: Any = None  # (fused query pass, capture limits, context_pass) of the layer that planned it
    # The expanded context pass (a layer's context_pass "expand" or "auto"): the StepPlan the
    # context pass runs instead, one request per token over its whole causal prefix in the cache
    # (see expanded_context_plan), with its own backend_state; None: the split.
    context_plan: Any = None

    def new_token_slots(self) -> torch.Tensor:
        """(T,) int64: flat slot of each new token in this rank's cache, -1 if not here."""
        positions = self.context_lens.long()[self.token_request] + self.token_offset
        return kv_slots(positions, self.token_request, self.block_table, self.page_size, self.layout, check=False)

    def write_new_tokens(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """Store the step's fresh K (or V) of the tokens this rank owns into its shard.

        Token i of a request goes to position C + i: in a tree step, its index, not its depth
        (after verification, write the accepted path again at C + depth with ``kv_slots``).

        cache: (P, page_size, H_kv, D), any strides (a view of a larger buffer too), written in
        place; new: (T, H_kv, D), same dtype.
        No host synchronisation (indices come from the plan): call it per layer. A CUDA graph that
        captures it writes this plan's slots at every replay: so for a plan of a layer with capture
        limits it refuses to be captured (see docs/api.md).
        """
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[1] != self.page_size:
            got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise ValueError(f"expected cache: (P, page_size = {self.page_size}, H_kv, D), got {got}")
        want = (self.num_tokens, *cache.shape[2:])
        if not isinstance(new, torch.Tensor) or new.shape != want or new.dtype != cache.dtype:
            got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"expected new: (T, H_kv, D) = {want} {cache.dtype} like cache, got {got}")
        device = self.write_slots.device
        for name, t in (("cache", cache), ("new", new)):
            if t.device != device:
                raise ValueError(f"expected {name} on {device}, the plan's device, got {t.device}")
        _check_pages(self, "cache.shape[0]", cache.shape[0])
        limits = self.made_for[1] if self.made_for is not None else None
        if limits is not None and limits.given and cache.is_cuda and torch.cuda.is_current_stream_capturing():
            # The slots, and how many this rank owns, are this step's: a graph replayed after later
            # plans (what capture limits are for) would write them again, silently wrong.
            raise ValueError(
                "expected write_new_tokens outside a CUDA graph for a plan of a layer with capture limits: a "
                "replay after a later plan would write this step's slots; write before the replay, or copy "
                "plan.new_token_slots() into the slot mapping of the engine's own cache-write kernel (-1: skip)"
            )
        page, offset = self.write_slots // self.page_size, self.write_slots % self.page_size
        cache.index_put_((page, offset), new.index_select(0, self.write_rows))


def _check_pages(plan: StepPlan, name: str, pages: int) -> None:
    """Raise unless every page the step uses on this rank is below ``pages`` (named ``name``)."""
    if plan.max_page_id >= pages:
        raise ValueError(
            f"expected block_table page ids < {name} = {pages} (pages of this rank's cache), "
            f"got page id {plan.max_page_id}"
        )


def _step_lengths(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Check a step's lengths (integer tensors, (B+1,) and (B,)); returns them as host lists and q_lens."""
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"expected query_start_loc.shape == (B+1,) = ({seq_lens.shape[0] + 1},), "
            f"got {tuple(query_start_loc.shape)}"
        )
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    if qsl[0] != 0:
        raise ValueError(f"expected query_start_loc[0] == 0, got {qsl[0]}")
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    for i, (q, n) in enumerate(zip(q_lens, sl)):
        if q < 0:
            raise ValueError(f"expected query_start_loc non-decreasing, got q_len {q} for request {i}")
        if n < 0:
            raise ValueError(f"expected seq_lens >= 0, got seq_lens[{i}] = {n}")
        if q > n:
            raise ValueError(
                f"expected q_len <= seq_len for every request, got q_len {q} > "
                f"seq_lens[{i}] = {n} (seq_lens counts the step's new tokens too)"
            )
    return qsl, sl, q_lens


def _tree_mask(parents: Any, qsl: list[int]) -> torch.Tensor:
    """Check tree ``parents`` ((T,) int, within-request indices) of a step; returns its ancestor mask on the host."""
    par = _int_tensor("parents", parents, 1)
    if par.device.type == "meta":  # read on the host below
        raise ValueError("expected parents with values, got a meta tensor")
    if par.shape[0] != qsl[-1]:
        raise ValueError(f"expected parents.shape == (T,) = ({qsl[-1]},), got {tuple(par.shape)}")
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    offset = torch.cat([torch.arange(q) for q in q_lens]) if q_lens else torch.zeros(0, dtype=torch.long)
    par_h = par.cpu().long()
    if bool(((par_h < -1) | (par_h >= offset)).any()):
        raise ValueError(
            "expected parents[t] == -1 or 0 <= parents[t] < t's index in its request "
            f"(parents before children), got {par_h.tolist()}"
        )
    return _ancestor_mask(par_h, qsl, max(q_lens, default=0))


def _ancestor_mask(parents: torch.Tensor, qsl: list[int], max_q: int) -> torch.Tensor:
    """(B, max_q, max_q) bool: [b, j, i] = token i is token j or one of its ancestors."""
    b = len(qsl) - 1
    mask = torch.zeros(b, max_q, max_q, dtype=torch.bool)
    par = parents.tolist()
    for r in range(b):
        for j in range(qsl[r + 1] - qsl[r]):
            mask[r, j, j] = True
            p = par[qsl[r] + j]
            if p >= 0:
                mask[r, j] |= mask[r, p]  # parents come first, so row p is complete
    return mask


def plan_step(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    page_size: int,
    layout: DCPLayout,
    parents: torch.Tensor | None = None,
) -> StepPlan:
    """Check a step's metadata and derive what both passes need.

    query_start_loc: (B+1,) int, cumulative query counts, starting at 0.
    seq_lens: (B,) int, global sequence length of each request *including* the
        step's new tokens (so context C_b = seq_lens[b] - q_len_b).
    block_table: (B, W) int, this rank's page ids; at least
        ceil(local_len(seq_lens[b], 0) / page_size) pages wide on every rank
        (rank 0's need, the largest), so the new tokens can be written too.
    page_size: tokens per page, a multiple of layout.interleave.
    layout: (N, r, I) of this rank.
    parents: optional (T,) int, tree speculation: parent of each new token as
        an index within its request (-1: a root, sees only the context and
        itself); parents precede children. None means a causal chain.

    Raises ValueError naming the argument for any inconsistency. Syncs with
    the host (it reads the lengths), once per step.
    """
    if not isinstance(layout, DCPLayout):
        raise ValueError(f"expected layout to be a DCPLayout, got {type(layout).__name__}")
    qsl_t = _int_tensor("query_start_loc", query_start_loc, 1)
    sl_t = _int_tensor("seq_lens", seq_lens, 1)
    bt = _int_tensor("block_table", block_table, 2)
    _check_page_size(page_size, layout)
    page_size = int(page_size)  # NumPy ints too, kept as a Python int
    device = qsl_t.device
    for name, t in (("seq_lens", sl_t), ("block_table", bt)):
        if t.device != device:
            raise ValueError(f"expected {name} on {device} like query_start_loc, got {t.device}")
    if device.type == "meta":  # read on the host below: a meta tensor has no values
        raise ValueError("expected query_start_loc, seq_lens and block_table with values, got meta tensors")
    qsl, sl, q_lens = _step_lengths(qsl_t, sl_t)
    b = len(sl)
    if bt.shape[0] != b:
        raise ValueError(f"expected block_table.shape[0] == B = {b}, got {tuple(bt.shape)}")

    n, r, il = layout.world_size, layout.rank, layout.interleave
    # Width is checked against rank 0's need (the largest of any rank), so a
    # table too narrow for some rank is refused on every rank alike: no rank
    # goes on into a collective that another rank will never reach.
    sl_c = torch.tensor(sl, dtype=torch.int64)  # one elementwise call per formula, not one per request
    need = local_pages(sl_c, n, il, 0, page_size).tolist()
    if b and max(need) > bt.shape[1]:
        i = need.index(max(need))
        raise ValueError(
            f"expected block_table with at least {need[i]} pages per request on every rank, got {bt.shape[1]}: "
            f"as wide as rank 0 needs (request {i} keeps local_len(seq_len={sl[i]}) = "
            f"{local_len(sl[i], n, il, 0)} tokens on rank 0, the most of any rank, at page_size {page_size}); "
            "pad the entries this rank does not use with -1"
        )
    mine = local_pages(sl_c, n, il, r, page_size).to(bt.device)
    used = torch.arange(bt.shape[1], device=bt.device)[None, :] < mine[:, None]
    if bool((bt < 0).logical_and(used).any()):
        b_bad = int((bt < 0).logical_and(used).any(dim=1).nonzero()[0])
        raise ValueError(
            f"expected page ids >= 0 in the first {int(mine[b_bad])} entries of block_table[{b_bad}], "
            f"got {bt[b_bad, : mine[b_bad]].tolist()}"
        )

    max_page_id = int(bt.masked_fill(~used, -1).max()) if bt.numel() else -1

    t = qsl[-1]
    ctx = [s - q for s, q in zip(sl, q_lens)]
    local_ctx = local_len(torch.tensor(ctx, dtype=torch.int64), n, il, r).tolist()
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    token_request = torch.repeat_interleave(torch.arange(b), q_lens_t)
    token_offset = torch.arange(t) - torch.tensor(qsl[:-1], dtype=torch.int64)[token_request]
    max_q = max(q_lens, default=0)

    query_mask = None
    if parents is not None:
        query_mask = _tree_mask(parents, qsl).to(device)

    i32 = dict(dtype=torch.int32, device=device)
    plan = StepPlan(
        layout=layout,
        page_size=page_size,
        num_tokens=t,
        batch_size=b,
        max_q_len=max_q,
        max_context_len=max(ctx, default=0),
        max_local_context_len=max(local_ctx, default=0),
        # Row-major copies, not the caller's tensors: kernels read them per layer, after the checks
        # above, and the stock ones (FA2/FA3's block table) want stride 1 in the last dim.
        query_start_loc=qsl_t.to(torch.int32, memory_format=torch.contiguous_format, copy=True),
        seq_lens=sl_t.to(torch.int32, memory_format=torch.contiguous_format, copy=True),
        q_lens=q_lens_t.to(**i32),
        context_lens=torch.tensor(ctx, **i32),
        local_context_lens=torch.tensor(local_ctx, **i32),
        block_table=bt.to(torch.int32, memory_format=torch.contiguous_format, copy=True),
        token_request=token_request.to(device),
        token_offset=token_offset.to(device),
        write_rows=torch.zeros(0, dtype=torch.int64, device=device),
        write_slots=torch.zeros(0, dtype=torch.int64, device=device),
        query_mask=query_mask,
        max_page_id=max_page_id,
    )
    slots = plan.new_token_slots()
    rows = (slots >= 0).nonzero().flatten()  # a host sync, once per step
    return replace(plan, write_rows=rows, write_slots=slots[rows])


def expanded_context_plan(plan: StepPlan) -> StepPlan:
    """The context pass of ``plan`` expanded: one request per token, over its whole causal prefix.

    Token j of request b becomes request t (its index in the step) with q_len 1 and
    context_lens[t] = C_b + j + 1 positions (its own included) read from the cache, so
    local_context_lens[t] = local_len(C_b + j + 1, r) slots of this rank's shard: a plain
    non-causal pass then gives each token exactly the keys the causal mask lets it see, the step's
    new tokens included, and no query pass is needed. Those must be in the cache before the pass
    (write_new_tokens). Exact for causal steps only (a tree's token does not see every earlier one).

    plan: a causal StepPlan (query_mask None). returns: a StepPlan for the context pass alone
    (B' = T requests; block_table (T, W) = plan.block_table[token_request]; nothing to write).
    Reads lengths on the host: call it at plan time.
    """
    if plan.query_mask is not None:
        raise ValueError("expected a causal step (no tree parents) to expand its context pass, got a tree mask")
    layout, t, dev = plan.layout, plan.num_tokens, plan.query_start_loc.device
    req, off = plan.token_request.cpu(), plan.token_offset.cpu()
    seen = plan.context_lens.cpu().long()[req] + off + 1
    local = local_len(seen, layout.world_size, layout.interleave, layout.rank)
    i32 = dict(dtype=torch.int32, device=dev)
    none = torch.zeros(0, dtype=torch.int64, device=dev)
    return replace(
        plan,
        batch_size=t,
        max_q_len=min(t, 1),
        max_context_len=int(seen.max()) if t else 0,
        max_local_context_len=int(local.max()) if t else 0,
        query_start_loc=torch.arange(t + 1, **i32),
        seq_lens=(seen + 1).to(**i32),  # formal: the pass reads context_lens keys and no new token
        q_lens=torch.ones(t, **i32),
        context_lens=seen.to(**i32),
        local_context_lens=local.to(**i32),
        block_table=plan.block_table.index_select(0, plan.token_request),
        token_request=torch.arange(t, device=dev),
        token_offset=torch.zeros(t, dtype=torch.int64, device=dev),
        write_rows=none,
        write_slots=none,
    )
