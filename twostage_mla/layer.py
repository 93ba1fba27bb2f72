"""The two-stage DCP attention layer: the one public entry point.

Per step, ``plan = attn.plan(...)`` on every rank (host sync allowed, kernel plans
built, the ranks agree the step is valid);
per layer, ``out = attn(q, k, v, k_cache, v_cache, plan)``, which on rank r:

1. query pass: q over the step's fresh K/V, causal, local heads -> (o_q, lse_q)
   (overlapping 2.)
2. all-gather q over the DCP group -> (T, N*H, D)
3. context pass: gathered q over this rank's shard, non-causal -> (o_c, lse_c)
4. combine across ranks by LSE (a2a or ag_rs) -> (o_ctx, lse_ctx), own heads
5. merge with (o_q, lse_q) -> output

With the fused query pass (the default on CUDA in bf16/fp16), 1. runs inside 5.,
one Triton kernel, and nothing overlaps 2. With the expanded context pass
(context_pass "expand", or "auto" where the backend prefers it), 3. runs one
request per token over its whole causal prefix, new tokens read from the
cache, and 1. and the query part of 5. are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from twostage_mla import comm
from twostage_mla.backends import AttentionSpec, CaptureLimits, select_backend, select_merge, select_query_merge
from twostage_mla.layout import DCPLayout, _int_arg
from twostage_mla.plan import StepPlan, _check_pages, expanded_context_plan, plan_step

CONTEXT_PASSES = ("split", "expand", "auto")

# Profiler ranges of the per-layer call, in order (cheap when no profiler runs).
PHASES = ("twostage.query_pass", "twostage.gather_q", "twostage.context_pass", "twostage.combine", "twostage.merge")


@dataclass(frozen=True)
class AttentionConfig:
    """Shapes of one attention layer on one rank; no model sizes built in.

    num_heads: query heads on this rank (after tensor parallelism), H.
    head_dim: D of q and K (MLA: kv_lora_rank + rope_dim, e.g. 512 + 64).
    head_dim_v: Dv of V and the output (MLA: kv_lora_rank).
    num_kv_heads: H_kv; 1 for MLA.
    kv_format: "mla" (V = K[..., :Dv], one cache tensor) or "gqa" (two caches).
    page_size: tokens per cache page, a multiple of the interleave.
    scale: softmax scale applied to q . k.
    """

    num_heads: int
    head_dim: int
    head_dim_v: int
    page_size: int
    scale: float
    num_kv_heads: int = 1
    kv_format: str = "mla"

    @classmethod
    def mla(cls, *, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int, scale: float) -> AttentionConfig:
        """MLA with absorbed queries: q (T, H, kv_lora_rank + rope_dim)."""
        _int_arg("kv_lora_rank", kv_lora_rank, 1)
        _int_arg("rope_dim", rope_dim, 0)
        return cls(num_heads, kv_lora_rank + rope_dim, kv_lora_rank, page_size, scale, 1, "mla")

    def __post_init__(self) -> None:
        # Sizes may come from a model config as NumPy scalars: kept as Python numbers, so that
        # equal configs hash alike (a plan's check, the agreement across ranks).
        for name in ("num_heads", "head_dim", "head_dim_v", "page_size", "num_kv_heads"):
            object.__setattr__(self, name, _int_arg(name, getattr(self, name), 1))
        if self.kv_format not in ("mla", "gqa"):
            raise ValueError(f"expected kv_format 'mla' or 'gqa', got {self.kv_format!r}")
        if self.kv_format == "mla" and (self.num_kv_heads != 1 or self.head_dim_v > self.head_dim):
            raise ValueError(
                f"expected num_kv_heads == 1 and head_dim_v <= head_dim for MLA (kv_format='mla', the default; "
                f"kv_format='gqa' for separate K and V heads), got num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, head_dim_v={self.head_dim_v}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_heads to be a multiple of num_kv_heads = {self.num_kv_heads}, got {self.num_heads}"
            )
        object.__setattr__(self, "scale", _check_scale(self.scale))


def _check_scale(scale: Any) -> float:
    """scale as a Python float; raise unless it is a finite real number > 0."""
    if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) and 0 < scale < math.inf):
        raise ValueError(
            f"expected scale to be a finite real number > 0 (a Python or NumPy float), got {scale!r} "
            f"({type(scale).__name__})"
        )
    return float(scale)


def _check(name: str, t: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected {name} to be a tensor of shape {want}, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"expected {name}.shape == {want}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"expected {name}.dtype == {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"expected {name} on {device}, got {t.device}")


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _spec(config: AttentionConfig, world_size: int, dtype: torch.dtype, device: torch.device) -> AttentionSpec:
    """What a layer of this config asks of a backend (the registry's input)."""
    return AttentionSpec(
        kv_format=config.kv_format,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        head_dim_v=config.head_dim_v,
        page_size=config.page_size,
        world_size=world_size,
        scale=config.scale,
        dtype=dtype,
        device=device,
    )


def _on_device(method: Callable) -> Callable:
    """Run a layer method with the layer's GPU as the current one: Triton, and some FlashInfer
    kernels, launch on the current GPU's stream whatever their tensors' device (cuda:1 while
    cuda:0 is current)."""

    @functools.wraps(method)
    def on_device(self: TwoStageAttention, *args: Any, **kwargs: Any) -> Any:
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return on_device


class TwoStageAttention:
    """Exact DCP attention for q_len >= 1 from a non-causal and a causal pass.

    config: shapes of the layer (see :class:`AttentionConfig`).
    layout: (N, r, I) of this rank.
    group: the DCP process group (size N, this process at rank r); may be
        None only when N == 1.
    combine: "a2a" (one all-to-all of (o, lse) + local merge) or "ag_rs"
        (all-gather lse, rescale, reduce-scatter).
    backend: "auto" or a name from :func:`twostage_mla.backends.backend_names`.
    dtype, device: of q, K/V and the cache.
    max_batch_size, max_tokens, max_pages: optional maxima (B, T, and pages
        one step's context pass reads on rank 0, the most of any rank); with
        all three given, the layer and its backend keep every per-step index
        they read in fixed buffers, so a graph captured once replays correctly
        after later plans of the same B and T. Only a backend that can do so
        serves them (flashinfer); with the fused query pass a plan stays valid
        until the next plan() of the layer that made it (unfused, FlashInfer
        keeps one plan per B for MLA, per (B, T) for GQA). Without them a captured graph is valid for the
        plan it was captured with.
    max_q_len: with those three, the most tokens of one request in any step
        (default max_tokens). With the fused query pass and max_q_len <= 16
        (speculative decoding), one graph serves causal and tree steps alike
        and uses the kernel's faster variant; otherwise tree steps are refused
        under capture limits.
    fuse_query: True runs the query pass inside the final merge (one Triton
        kernel, :mod:`twostage_mla.kernels.query_merge`) instead of the
        backend's own query pass plus a merge; needs CUDA, Triton and bf16
        or fp16. False never does. None (default): fused wherever that kernel
        runs. Measured on H200 in docs/performance.md.
    context_pass: "split" (default): the non-causal context pass plus the
        causal query pass over the fresh K/V, merged; the cache need not hold
        the step's new tokens. "expand": the context pass alone, one request
        per token over its whole causal prefix (no query pass, no query
        merge); reads the new tokens from the cache, so the caller stores
        them there before the call (plan.write_new_tokens, or the engine's
        cache write, as for any paged kernel); causal steps only, no capture
        limits. "auto": "expand" where the backend measured it faster
        (AttentionBackend.prefers_expanded_context; FlashInfer MLA at 64+
        gathered heads, 16384+ packed rows a step and 256+ a request:
        compute-bound; or one token per request: the cache is read once
        either way) and the step allows it, else "split"; the same
        contract as "expand".

    One instance serves every layer with this config; ``plan`` once per step,
    then call it per layer. Example (one rank, CPU)::

        attn = TwoStageAttention(AttentionConfig.mla(num_heads=16, kv_lora_rank=512,
                                 rope_dim=64, page_size=64, scale=0.1), DCPLayout(),
                                 dtype=torch.float32)
        plan = attn.plan(query_start_loc, seq_lens, block_table)
        out = attn(q, kv_new, None, kv_cache, None, plan)   # (T, 16, 512)
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: DCPLayout,
        *,
        group: dist.ProcessGroup | None = None,
        combine: str = "a2a",
        backend: str = "auto",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        max_batch_size: int | None = None,
        max_tokens: int | None = None,
        max_pages: int | None = None,
        max_q_len: int | None = None,
        fuse_query: bool | None = None,
        context_pass: str = "split",
    ) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):  # nothing to agree through
            got = repr(group)
            if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() hands a process outside it
                got = "GroupMember.NON_GROUP_MEMBER (this process is not in that group)"
            raise ValueError(f"expected group to be a torch.distributed ProcessGroup or None, got {got}")
        if isinstance(layout, DCPLayout) and layout.world_size > 1 and group is None:
            raise ValueError(f"expected a process group of size {layout.world_size}, got group=None")
        # With a group of more than one rank, the ranks agree on the layer here (one small
        # all-reduce, once per layer): where one rank refuses its setup every rank raises, rather
        # than wait in a later collective for it, and layers that differ across ranks (a combine
        # that would hang, a scale that would be wrong) are refused on every rank. Only the DCP group
        # can say so: another group's ranks are not building this layer, so a rank given a group of
        # another size raises alone (its setup refuses the size) instead of waiting in theirs.
        size = dist.get_world_size(group) if group is not None else 1
        agreeing = size > 1 and (not isinstance(layout, DCPLayout) or size == layout.world_size)
        try:
            self._setup(config, layout, group, combine, backend, dtype, device, fuse_query,
                        CaptureLimits(max_batch_size, max_tokens, max_pages, max_q_len), context_pass)  # fmt: skip
        except Exception:
            if agreeing:
                comm.agree("layer", [1, 0], group, device)
            raise
        if agreeing:
            rows = comm.agree("layer", [0, self._layer_digest], group, self.device)
            refused = [r for r, row in enumerate(rows) if row[0]]
            if refused:
                raise ValueError(
                    f"expected every rank of the DCP group to accept this layer, got a refusal on rank(s) {refused} "
                    "(their error names the argument)"
                )
            if len({row[1] for row in rows}) > 1:
                raise ValueError(
                    "expected the same layer on every rank of the DCP group (config, world_size, interleave, "
                    f"combine, dtype, context_pass), got different ones on ranks {comm.differing(rows)}"
                )

    def _setup(self, config, layout, group, combine, backend, dtype, device, fuse_query, limits, context_pass) -> None:
        if not isinstance(config, AttentionConfig):
            raise ValueError(f"expected config to be an AttentionConfig, got {type(config).__name__}")
        if not isinstance(layout, DCPLayout):
            raise ValueError(f"expected layout to be a DCPLayout, got {type(layout).__name__}")
        if config.page_size % layout.interleave:
            raise ValueError(
                f"expected page_size to be a multiple of interleave = {layout.interleave}, got {config.page_size}"
            )
        if combine not in comm.COMBINE_METHODS:
            raise ValueError(f"expected combine in {comm.COMBINE_METHODS}, got {combine!r}")
        if context_pass not in CONTEXT_PASSES:
            raise ValueError(f"expected context_pass in {CONTEXT_PASSES}, got {context_pass!r}")
        if context_pass == "expand" and limits.given:
            raise ValueError(
                "expected context_pass 'split' or 'auto' with capture limits (max_batch_size, max_tokens, max_pages), "
                "got 'expand': the expanded pass has a request per token, which the fixed buffers are not sized for"
            )
        self.context_pass = context_pass
        if group is not None:  # a group that disagrees with the layout would read the wrong shard
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if (size, rank) != (layout.world_size, layout.rank):
                raise ValueError(
                    f"expected group of size {layout.world_size} with this process at rank "
                    f"{layout.rank} (the layout), got size {size}, rank {rank}"
                )
        self.config, self.layout, self.group, self.combine = config, layout, group, combine
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"expected dtype to be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        try:
            self.dtype, self.device = dtype, torch.device(device)
        except (RuntimeError, TypeError):
            want = "a torch.device or a string like 'cuda:0'"
            raise ValueError(f"expected device to be {want}, got {device!r}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"expected device {str(self.device)!r} to exist, but torch.cuda.is_available() is False")
        if self.device.type == "cpu":  # "cpu:0" is "cpu": tensors on the CPU report no index
            self.device = torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current GPU: name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and self.device.index >= torch.cuda.device_count():
            raise ValueError(
                f"expected device {str(self.device)!r} to exist, but this machine has "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        self.spec = _spec(config, layout.world_size, dtype, self.device)
        self.backend = select_backend(self.spec, backend, limits)(self.spec, limits)
        self.merge = select_merge(self.spec)
        if fuse_query is not None and not isinstance(fuse_query, bool):  # 1 == True, but not what a user meant
            raise ValueError(f"expected fuse_query in (None, True, False), got {fuse_query!r}")
        fused = select_query_merge(self.spec)
        if fuse_query and fused is None:
            raise ValueError(
                f"expected fuse_query None (the default: fused where it runs) or False on {self.device} with "
                f"{dtype}, got True: the fused kernel needs CUDA, Triton and bf16 or fp16"
            )
        self.query_merge = fused if fuse_query in (None, True) else None
        self.backend.use_query_pass(self.query_merge is None)
        # With capture limits the fused kernel reads the step's indices from fixed buffers that
        # plan() refills (a replayed graph reads the addresses it was captured with), and it is
        # compiled for the longest request of any step, not of the step it was captured with.
        self._fixed: dict[str, torch.Tensor] = {}
        self._fixed_count = [0]  # plans written into them; a plan keeps its number (StepPlan.fixed_version)
        # What every rank's layer must share, agreed in __init__ (the backend may differ: same maths).
        # By value, not repr: scale=1 and scale=1.0 (or a numpy float) are the same layer.
        layer = [float(v).hex() if f.name == "scale" else v for f in fields(config) for v in [getattr(config, f.name)]]
        self._layer_digest = comm.digest(*layer, layout.world_size, layout.interleave, combine, dtype, context_pass)

    @property
    def _made_for(self) -> tuple[bool, CaptureLimits, str]:
        """A plan serves layers that planned alike: the fused kernel, the limits and the context pass
        decide what it holds (and a split layer's caller need not have cached the new tokens)."""
        return self.query_merge is not None, self.backend.limits, self.context_pass

    @_on_device
    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        parents: torch.Tensor | None = None,
        num_pages: int | None = None,
    ) -> StepPlan:
        """Per-step plan, shared by every layer (see :func:`plan_step`).

        query_start_loc: (B+1,) int32; seq_lens: (B,) int32 global lengths
        including the step's tokens; block_table: (B, W) int32;
        parents: optional (T,) int tree parents. All on this layer's device;
        any signed integer dtype is accepted (the plan keeps int32 copies).
        num_pages: optional, pages P of this rank's caches: page ids the step
            uses must be below it (the layer call checks k_cache.shape[0] too).
        returns: the StepPlan every layer of this step takes, with the
            backend's kernel plans in it.

        With N > 1 the ranks of the group agree on the step here (one small
        all-reduce): where any rank refuses its metadata, every rank raises,
        so none goes on into a layer call that another never reaches.
        """
        try:
            plan = self._plan(query_start_loc, seq_lens, block_table, parents, num_pages)
        except Exception:
            self._agree(None, None)  # this rank refused: say so to the others, then raise its own error
            raise
        self._agree(plan, parents)
        return plan

    def _agree(self, plan: StepPlan | None, parents: torch.Tensor | None) -> None:
        """Raise on every rank unless every rank of the group planned the same step (no-op for N = 1).

        plan: this rank's plan, None where it refused the step. One all-reduce of rows (refused, T,
        B, digest of the step's query_start_loc, seq_lens and parents), one per rank: the step is
        the same on every rank, or the layer's collectives would not match (a hang, or a silently
        wrong answer); the layer itself was agreed in __init__. Where the group refuses, every rank
        also drops the plans it made before that its kernels hold (some ranks' were re-planned, the
        refusing ones' not), so all refuse them alike (invalidate_plans; a no-op where plans hold
        their own tensors).
        """
        if self.layout.world_size == 1:
            return
        if plan is None:
            row = [1, 0, 0, 0, 0]
        else:
            digest = comm.digest(plan.query_start_loc, plan.seq_lens, parents)
            row = [0, plan.num_tokens, plan.batch_size, digest, int(plan.context_plan is not None)]
        rows = comm.agree("step", row, self.group, self.device)
        refused = [r for r, row in enumerate(rows) if row[0]]
        if not refused and len({tuple(row) for row in rows}) == 1:
            return
        self._fixed_count[0] += 1
        self.backend.invalidate_plans()
        if plan is None:  # this rank raises its own error
            return
        if refused:
            raise ValueError(
                f"expected every rank of the DCP group to accept this step's metadata, got a refusal on rank(s) "
                f"{refused} (their error names the argument)"
            )
        if len({tuple(row[:4]) for row in rows}) == 1:  # the same step, expanded on some ranks only
            raise ValueError(
                "expected the same context pass on every rank of the DCP group, got the expanded one on ranks "
                f"{[r for r, row in enumerate(rows) if row[4]]} only (context_pass='auto' with backends that "
                "differ across ranks): pass context_pass 'split' or 'expand'"
            )
        counts = ", ".join(f"rank {r}: T={x[1]} B={x[2]}" for r, x in enumerate(rows))
        raise ValueError(
            "expected the same query_start_loc, seq_lens and parents on every rank of the DCP group, got different "
            f"ones on ranks {comm.differing(rows)} ({counts})"
        )

    def _plan(self, query_start_loc, seq_lens, block_table, parents, num_pages) -> StepPlan:
        for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise ValueError(f"expected {name} on {self.device}, got {t.device}")
        plan = plan_step(
            query_start_loc, seq_lens, block_table, page_size=self.config.page_size, layout=self.layout, parents=parents
        )
        if num_pages is not None:
            _check_pages(plan, "num_pages", _int_arg("num_pages", num_pages, 1))
        limits = self.backend.limits
        # Under capture limits, requests of up to 16 tokens through the fused kernel get a fixed
        # (max_batch_size, max_q_len, max_q_len) mask, causal on causal steps: one graph serves
        # chains and trees. Elsewhere a tree mask would be a per-step tensor a graph cannot follow.
        masked = limits.given and self.query_merge is not None and limits.longest_request <= 16
        if limits.given and parents is not None and not masked:
            raise ValueError(
                "expected no tree parents with capture limits (max_batch_size, max_tokens, max_pages) unless "
                f"the query pass is fused and max_q_len <= 16, got fused={self.query_merge is not None}, "
                f"max_q_len = {limits.longest_request}: no fixed buffer holds the mask otherwise"
            )
        if limits.given and plan.max_q_len > limits.longest_request:
            raise ValueError(
                f"expected requests of at most max_q_len = {limits.longest_request} tokens (capture limits), "
                f"got one of {plan.max_q_len}"
            )
        # B and T sized the layer's own fixed buffers below; pages are the backend's (it checks them).
        limits.check(max_batch_size=plan.batch_size, max_tokens=plan.num_tokens)
        stamp = dict(backend=self.backend.name, spec=self.spec, made_for=self._made_for)
        if self._expands(plan):
            ctx = expanded_context_plan(plan)
            ctx = replace(ctx, backend_state=self.backend.plan(ctx), **stamp)
            return replace(plan, context_plan=ctx, **stamp)
        state = self.backend.plan(plan)
        if limits.given and self.query_merge is not None:
            plan = self._into_fixed_buffers(plan, masked)
        return replace(plan, backend_state=state, **stamp)

    def _expands(self, plan: StepPlan) -> bool:
        """Whether this step runs the expanded context pass (context_pass, the step, the backend)."""
        if self.context_pass == "split" or plan.num_tokens == 0:
            return False
        if plan.query_mask is not None:
            if self.context_pass == "expand":
                raise ValueError(
                    "expected no tree parents with context_pass='expand': a tree's token does not see every "
                    "earlier token of its request; use 'split' or 'auto' (which splits tree steps)"
                )
            return False
        if self.context_pass == "expand":
            return True
        return not self.backend.limits.given and self.backend.prefers_expanded_context(plan)

    def _into_fixed_buffers(self, plan: StepPlan, masked: bool) -> StepPlan:
        """The plan, stamped, with fused_plan: a copy whose kernel indices are the layer's fixed buffers."""
        limits, t, b, dev = self.backend.limits, plan.num_tokens, plan.batch_size, self.device
        if not self._fixed:
            n = limits.longest_request
            self._fixed["token_offset"] = torch.zeros(limits.max_tokens, dtype=torch.int64, device=dev)
            if masked:
                self._fixed["token_request"] = torch.zeros(limits.max_tokens, dtype=torch.int64, device=dev)
                self._fixed["query_start_loc"] = torch.zeros(limits.max_batch_size + 1, dtype=torch.int32, device=dev)
                self._fixed["query_mask"] = torch.zeros(limits.max_batch_size, n, n, dtype=torch.bool, device=dev)
                self._fixed["causal"] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # token j sees 0 .. j
        self._fixed_count[0] += 1
        fixed = {"token_offset": self._fixed["token_offset"][:t].copy_(plan.token_offset)}
        if masked:
            fixed["token_request"] = self._fixed["token_request"][:t].copy_(plan.token_request)
            fixed["query_start_loc"] = self._fixed["query_start_loc"][: b + 1].copy_(plan.query_start_loc)
            mask = self._fixed["query_mask"][:b]
            if plan.query_mask is None:  # a causal step
                mask.copy_(self._fixed["causal"])
            else:
                q = plan.max_q_len
                mask.zero_()[:, :q, :q].copy_(plan.query_mask)
            fixed["query_mask"] = mask
        version = (self._fixed_count, self._fixed_count[0])
        return replace(plan, fixed_version=version, fused_plan=replace(plan, **fixed))

    def _checked(self, q, k, v, k_cache, v_cache, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """The layer call's arguments checked against the config and the plan (no communication, no
        host sync), as (q, k, v, v_cache) with stride 1 in the head dim (MLA: v and v_cache views of K)."""
        ok = isinstance(plan, StepPlan) and (plan.backend, plan.spec, plan.layout, plan.made_for) == (
            self.backend.name,
            self.spec,
            self.layout,
            self._made_for,
        )
        if not ok:  # a plan of another config would run with its heads, scale or metadata
            def made_for(key: tuple | None) -> str:
                if key is None:
                    return ""
                return f", fused={key[0]}, context_pass={key[2]!r}" + (f", {key[1]}" if key[1].given else "")

            raise ValueError(
                f"expected plan from plan() of a layer with this config (backend {self.backend.name!r}, "
                f"{self.layout}, {self.spec.summary()}, scale={self.spec.scale}{made_for(self._made_for)}), got "
                + (
                    f"backend {plan.backend!r}, {plan.layout}, "
                    + (f"{plan.spec.summary()}, scale={plan.spec.scale}" if plan.spec else "no spec")
                    + made_for(plan.made_for)
                    if isinstance(plan, StepPlan)
                    else type(plan).__name__
                )
            )
        if plan.fixed_version is not None and plan.fixed_version[0][0] != plan.fixed_version[1]:
            raise ValueError(
                "expected the latest plan of the layer that made it: under capture limits its fixed buffers hold "
                "one step's indices at a time, and plan() has been called again since this plan was made"
            )
        # A plan its kernels no longer hold: refused here, before any collective.
        self.backend.check_plan(plan.context_plan or plan)
        cfg, t = self.config, plan.num_tokens
        hk, d, dv = cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v
        _check("q", q, (t, cfg.num_heads, d), self.dtype, self.device)
        _check("k", k, (t, hk, d), self.dtype, self.device)
        _check("k_cache", k_cache, (None, cfg.page_size, hk, d), self.dtype, self.device)
        if cfg.kv_format == "mla":
            if v is not None or v_cache is not None:
                raise ValueError("expected v=None and v_cache=None for MLA (V is the first head_dim_v values of K)")
            v_cache = k_cache[..., :dv]  # v is taken from k below, after its stride is checked
        else:
            _check("v", v, (t, hk, dv), self.dtype, self.device)
            _check("v_cache", v_cache, (k_cache.shape[0], cfg.page_size, hk, dv), self.dtype, self.device)
        _check_pages(plan, "k_cache.shape[0]", k_cache.shape[0])  # a page past the cache would be read out of bounds
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.stride(-1) != 1:  # any other stride is the engine's to choose
                raise ValueError(f"expected {name} with stride 1 in its last dim, got strides {c.stride()}")
        # Stock kernels read a head's values with stride 1: the step's q, k, v (small) are copied
        # where they are not; the caches never are (checked above).
        q, k = _unit_stride(q), _unit_stride(k)
        v = k[..., :dv] if cfg.kv_format == "mla" else _unit_stride(v)
        return q, k, v, v_cache

    @_on_device
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: StepPlan,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of the step's queries over context + new tokens, local heads.

        Where the plan expands the context pass (context_pass "expand" or "auto"),
        k_cache (and v_cache) must already hold the step's new tokens.

        q: (T, H, D) dtype, this rank's heads (MLA: absorbed queries).
        k: (T, H_kv, D) dtype, the step's fresh keys (MLA: the latent + rope).
        v: (T, H_kv, Dv) dtype; None for MLA (V = k[..., :Dv]).
        k_cache: (P, page_size, H_kv, D) dtype, this rank's shard.
        v_cache: (P, page_size, H_kv, Dv) dtype; None for MLA.
        plan: from :meth:`plan` for this step.
        returns out (T, H, Dv) dtype, and lse (T, H) float32 if return_lse.

        No host synchronisation: capturable in a CUDA graph once planned.
        """
        q, k, v, v_cache = self._checked(q, k, v, k_cache, v_cache, plan)
        cfg, t, hk, dv = self.config, plan.num_tokens, self.config.num_kv_heads, self.config.head_dim_v
        if t == 0:  # every rank of the group has the step's T: all return here, none waits in a collective
            out = q.new_zeros((0, cfg.num_heads, dv))
            lse = torch.zeros((0, cfg.num_heads), dtype=torch.float32, device=self.device)
            return (out, lse) if return_lse else out

        n, q_local, ctx_plan = self.layout.world_size, q, plan.context_plan or plan
        if n > 1:
            gathered, work = comm.gather_queries(q, self.group)
        if self.query_merge is None and plan.context_plan is None:
            with record_function(PHASES[0]):
                o_q, lse_q = self.backend.query(q, k, v, plan)  # overlaps the all-gather
        if n > 1:
            with record_function(PHASES[1]):
                work.wait()
                q = comm.from_rank_major(gathered, hk)
        with record_function(PHASES[2]):
            o_c, lse_c = self.backend.context(q, k_cache, v_cache, ctx_plan)
        if n == 1:
            o_c, lse_c = o_c[None], lse_c[None]
        else:
            with record_function(PHASES[3]):
                o_c, lse_c = comm.to_rank_major(o_c, n, hk), comm.to_rank_major(lse_c, n, hk)
                if self.combine == "a2a":  # the N received states are merged in step 5
                    o_c, lse_c = comm.exchange_a2a(o_c, lse_c, self.group)
                else:
                    o_c, lse_c = comm.combine_ag_rs(o_c, lse_c, self.group)
                    o_c, lse_c = o_c[None], lse_c[None]
        with record_function(PHASES[4]):
            if plan.context_plan is not None:  # the context states hold every key: merge the ranks' alone
                if o_c.shape[0] == 1 and o_c.dtype == self.dtype:  # N = 1: the pass's own answer
                    out, lse = o_c[0], lse_c[0]
                else:
                    out, lse = self.merge(o_c, lse_c, out_dtype=self.dtype)
            elif self.query_merge is None:
                out, lse = self.merge(o_c, lse_c, extra=(o_q, lse_q), out_dtype=self.dtype)
            else:  # query pass and merge in one kernel
                kplan, longest = plan.fused_plan or plan, self.backend.limits.longest_request
                out, lse = self.query_merge(q_local, k, v, kplan, o_c, lse_c, scale=cfg.scale, out_dtype=self.dtype,
                                            max_q_len=longest)  # fmt: skip
        return (out, lse) if return_lse else out
