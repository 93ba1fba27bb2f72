"""The protocol every kernel backend implements.

A backend is a class that declares what it supports as class attributes and
implements the kernel contract (docs/design.md, "The split"):

    context(q, k_cache, v_cache, plan) -> (o, lse)   non-causal, paged, per-request kv length
    query(q, k, v, plan) -> (o, lse)                 the step's fresh K/V, causal (or tree mask)

Both return a state as in :mod:`twostage_mla.state`: o (T, H, Dv) in q's
dtype, lse (T, H) float32 natural log, (0, -inf) for rows with no keys.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import numbers
import re
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from twostage_mla.backends._dense import State, dense_query
from twostage_mla.plan import StepPlan


@dataclass(frozen=True)
class CaptureLimits:
    """Maxima a backend sizes its persistent buffers from, for CUDA-graph replay across steps.

    max_batch_size: B at most; max_tokens: T at most; max_pages: pages one
    step's context pass reads on rank 0 at most (sum over requests; rank 0
    holds the most, so every rank checks the same count).
    None everywhere (the default): buffers follow each step, and a captured
    graph stays valid only for the plan it was captured with.
    max_q_len: tokens of one request at most (optional, only with the three
    above; None means max_tokens, and more counts as max_tokens). Where it is <= 16 the fused query kernel
    compiles a faster variant and the layer keeps a fixed tree mask.
    Some of the three without the others raise.
    """

    max_batch_size: int | None = None
    max_tokens: int | None = None
    max_pages: int | None = None
    max_q_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_tokens", "max_pages", "max_q_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1):
                raise ValueError(f"expected {name} to be None or a positive int, got {v!r}")
            if v is not None:
                object.__setattr__(self, name, int(v))  # NumPy ints too, kept as Python ints
        three = {"max_batch_size": self.max_batch_size, "max_tokens": self.max_tokens, "max_pages": self.max_pages}
        missing = [k for k, v in three.items() if v is None]
        # Some limits without the others would give no fixed buffers, silently: a graph replayed
        # after another plan would then read the captured step's indices.
        if missing and (len(missing) < 3 or self.max_q_len is not None):
            given = [k for k, v in {**three, "max_q_len": self.max_q_len}.items() if v is not None]
            raise ValueError(
                f"expected capture limits max_batch_size, max_tokens and max_pages all given or none, got "
                f"{', '.join(given)} without {', '.join(missing)}"
            )

    @property
    def given(self) -> bool:
        return None not in (self.max_batch_size, self.max_tokens, self.max_pages)

    @property
    def longest_request(self) -> int | None:
        """Tokens of one request at most in any step, where the limits are given; else None."""
        return min(self.max_q_len or self.max_tokens, self.max_tokens) if self.given else None

    def check(self, **have: int) -> None:
        """Raise unless each named count (e.g. max_tokens=T) is within its limit, where given."""
        for name, value in have.items():
            cap = getattr(self, name)
            if cap is not None and value > cap:
                raise ValueError(f"expected a step within {name} = {cap} (the layer's capture limits), got {value}")


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer asks of a backend; fixed when the layer is built.

    kv_format: "mla" (one latent KV head; V is the first head_dim_v values
        of K) or "gqa" (separate K and V caches, num_kv_heads heads).
    num_heads: query heads on this rank (H_loc); the context pass sees
        world_size * num_heads of them after the all-gather.
    num_kv_heads: H_kv (1 for MLA). head_dim: D of q and K (MLA: latent + rope).
    head_dim_v: Dv of V and the output (MLA: the latent). page_size: tokens
        per cache page. world_size: N. scale: softmax scale of q . k.
    dtype: of q, K, V and the output. device: where the layer runs.
    """

    kv_format: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    page_size: int
    world_size: int
    scale: float
    dtype: torch.dtype
    device: torch.device

    def summary(self) -> str:
        return (
            f"{self.kv_format} heads={self.num_heads}x{self.world_size} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim}/{self.head_dim_v} page_size={self.page_size} "
            f"dtype={self.dtype} device={self.device}"
        )


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported; a stand-in in sys.modules without a __spec__ (a test's
    stub) counts when it is there, where find_spec itself would raise."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:
        return module in sys.modules


@functools.cache
def _installed_version(dist: str) -> str | None:
    """The installed release of a distribution, None without metadata; read once (every layer built asks)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """'0.5.3' -> (0, 5, 3); '2.6.0.post1' -> (2, 6, 0): the leading numbers, enough to order releases."""
    return tuple(int(m.group()) for m in (re.match(r"\d+", p) for p in version.split(".")[:3]) if m)


def gpu_capability(spec: AttentionSpec) -> tuple[int, int] | None:
    """The compute capability of spec's GPU; None off CUDA or where no GPU can be asked."""
    if spec.device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(spec.device)
    return None


class AttentionBackend:
    """Base of every backend: capability declarations and the two passes."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    kv_formats: ClassVar[tuple[str, ...]] = ()
    max_head_dim: ClassVar[int] = 1 << 30
    head_dims: ClassVar[tuple[tuple[int, int], ...] | None] = None  # allowed (D, Dv) pairs
    page_size_multiple: ClassVar[int] = 1
    packages: ClassVar[tuple[str, ...]] = ()  # import names that must be installed
    # (distribution, version): the oldest release the backend's calls were written and run against
    min_version: ClassVar[tuple[str, str] | None] = None
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    # Keeps its per-step metadata in fixed buffers sized by CaptureLimits, so a
    # CUDA graph captured once replays correctly after later plans.
    replays_across_steps: ClassVar[bool] = False

    @classmethod
    def environment_problems(cls, spec: AttentionSpec) -> list[str]:
        """Package missing, GPU too old: listed first when a backend is refused."""
        out = [f"package {p!r} is not installed" for p in cls.packages if not _importable(p)]
        if cls.min_version and not out:
            dist, want = cls.min_version
            have = _installed_version(dist) or want  # built from source without metadata: trusted
            if _release(have) < _release(want):
                out.append(f"{dist} {have} is older than {want}, the oldest release it was written for")
        cc, have = cls.min_compute_capability, gpu_capability(spec)
        if cc and have and have < cc:
            out.append(f"needs compute capability >= {cc}, the GPU has {have}")
        return out

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, limits: CaptureLimits | None = None) -> list[str]:
        """Why this backend cannot serve ``spec`` (under ``limits``), one line each; [] if it can."""
        reasons = cls.environment_problems(spec)
        if limits is not None and limits.given and not cls.replays_across_steps:
            reasons.append(
                "keeps no metadata in fixed buffers, so capture limits (max_batch_size, max_tokens, max_pages) "
                "cannot make its CUDA graphs replay across steps"
            )
        if spec.device.type not in cls.devices:
            reasons.append(f"device {spec.device.type!r} not in {cls.devices}")
        if spec.dtype not in cls.dtypes:
            reasons.append(f"dtype {spec.dtype} not in {[str(d) for d in cls.dtypes]}")
        if spec.kv_format not in cls.kv_formats:
            reasons.append(f"kv_format {spec.kv_format!r} not in {cls.kv_formats}")
        if max(spec.head_dim, spec.head_dim_v) > cls.max_head_dim:
            reasons.append(f"head dim {spec.head_dim}/{spec.head_dim_v} > {cls.max_head_dim}")
        if cls.head_dims is not None and (spec.head_dim, spec.head_dim_v) not in cls.head_dims:
            reasons.append(f"head dims {(spec.head_dim, spec.head_dim_v)} not in {cls.head_dims}")
        if spec.page_size % cls.page_size_multiple:
            reasons.append(f"page_size {spec.page_size} not a multiple of {cls.page_size_multiple}")
        return reasons + cls.extra_reasons(spec)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Backend-specific refusals beyond the declared attributes."""
        return []

    # False when the layer fuses the query pass into its merge kernel: query()
    # is then never called, and plan() need not prepare it.
    query_pass: bool = True

    def use_query_pass(self, on: bool) -> None:
        """Whether the layer will call :meth:`query` (False: the layer fuses the query pass).

        The layer calls it once, at construction; a backend whose own query pass cannot serve
        its spec and limits raises ValueError here.
        """
        self.query_pass = on

    def __init__(self, spec: AttentionSpec, limits: CaptureLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or CaptureLimits()

    def _plan_state(self, plan: StepPlan, kind: type) -> Any:
        """plan.backend_state, checked to be of ``kind`` (a plan made by this backend's plan())."""
        if not isinstance(plan.backend_state, kind):
            raise ValueError(
                f"expected plan.backend_state from {type(self).__name__}.plan, got {type(plan.backend_state).__name__}"
            )
        return plan.backend_state

    def plan(self, plan: StepPlan) -> Any:
        """Per-step kernel plans, built once per step and reused by every layer; None if none.

        plan: the step's StepPlan (lengths, block table, per-token indices; no backend state yet).
        returns: what the layer stores as ``plan.backend_state`` for this backend's passes.
        """
        return None

    def prefers_expanded_context(self, plan: StepPlan) -> bool:
        """Whether a layer with context_pass="auto" expands this step's context pass
        (:func:`twostage_mla.plan.expanded_context_plan`: one request per token over its whole
        causal prefix, no query pass, no query merge). Where the context pass is compute-bound the
        expanded pass costs about what the split's does, and the query pass and its merge are saved.
        False here: a backend says True only where it was measured faster.

        plan: the step's causal StepPlan, without backend state.
        """
        return False

    def check_plan(self, plan: StepPlan) -> None:
        """Raise unless this backend's kernels can still run ``plan`` (a no-op where plans hold
        their own tensors). The layer calls it before any collective."""

    def invalidate_plans(self) -> None:
        """Make every plan made so far refuse to run (after a step the group refused).

        A no-op where plans hold their own tensors; backends whose kernels keep one step's plan
        (FlashInfer's wrappers) override it.
        """

    def context(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan) -> State:
        """Non-causal pass over this rank's shard.

        q: (T, world_size*num_heads, D), heads ordered kv-head-major (see layer).
        k_cache: (P, page_size, H_kv, D); v_cache: (P, page_size, H_kv, Dv)
            (for MLA a view of k_cache's first Dv values).
        Request b reads slots 0 .. plan.local_context_lens[b]-1 through
        plan.block_table[b]. returns o (T, world_size*num_heads, Dv) q.dtype and
        lse (T, world_size*num_heads) float32, heads as in q.
        """
        raise NotImplementedError

    def query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """Pass over the step's fresh K/V, causal per request (or plan.query_mask).

        q: (T, num_heads, D); k: (T, H_kv, D); v: (T, H_kv, Dv).
        returns o (T, num_heads, Dv) q.dtype, lse (T, num_heads) float32.
        A step with no tokens, or with a tree mask, is served here for every
        backend (the reference's dense pass: a few tokens per request);
        the rest goes to :meth:`_query`, the backend's causal kernel.
        """
        if q.shape[0] == 0 or plan.query_mask is not None:
            return dense_query(q, k, v, plan, self.spec.scale)
        return self._query(q, k, v, plan)

    def _query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> State:
        """The causal kernel of :meth:`query`: T > 0 tokens, no tree mask."""
        raise NotImplementedError
