"""Attention states and their log-sum-exp algebra.

An attention state over a key set S is ``(o, lse)`` with

    lse = log(sum_{k in S} exp(s_k))          natural log, float32, (T, H)
    o   = sum_{k in S} exp(s_k - lse) v_k      compute dtype, (T, H, Dv)

for scores ``s_k = scale * q . k``. For disjoint key sets A and B the state of
A u B is

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

The empty set has the state ``(0, -inf)``; merging it changes nothing, and
merging two empty states gives the empty state (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NEG_INF = float("-inf")

# A merge implementation: (o (K, T, H, Dv), lse (K, T, H), *, out_dtype, extra) -> (o, lse).
MergeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def lse_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged lse and each state's weight exp(lse_k - lse), over dim 0.

    lses: (K, ...) float32, -inf for empty states. returns lse (...) and
    weights (K, ...) summing to 1, or all 0 (not NaN) where every state is
    empty; NaN where a state's lse is NaN.
    """
    # Shift by the largest lse and divide by the sum: the weights then sum to 1 however large
    # the lse (exp(lse_k - logsumexp) alone carries logsumexp's rounding, ~|lse| * 2^-24, into o).
    # Where every state is empty, shift by 0 so each weight is exp(-inf) = 0.
    if lses.shape[0] == 0:  # no states: the empty state
        return torch.full(lses.shape[1:], NEG_INF, dtype=lses.dtype, device=lses.device), lses
    m = lses.amax(dim=0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(lses - m)
    total = e.sum(dim=0)
    return m + torch.log(total), e / torch.where(total == 0, torch.ones_like(total), total)


def _check_floats(out_dtype: torch.dtype | None, **tensors: torch.Tensor) -> None:
    """Raise unless every tensor is a real floating tensor on one device, and out_dtype None or a float dtype."""
    devices = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"expected {name} to be a floating-point tensor, got {got}")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"expected {', '.join(tensors)} on one device, got {sorted(map(str, devices))}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"expected out_dtype to be None or a floating torch.dtype, got {out_dtype!r}")


def merge_states(
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge K states over disjoint key sets, stacked on dim 0.

    o: (K, T, H, Dv) any float dtype.
    lse: (K, T, H) float32, natural log, -inf for empty states (their o is
        not read, so it may be garbage); a NaN lse makes that row NaN.
    out_dtype: dtype of the merged o (default: o's dtype).
    extra: optional one more state (o (T, H, Dv), lse (T, H)) to merge in.
    returns: o (T, H, Dv) out_dtype, lse (T, H) float32.

    >>> o, lse = merge_states(torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2))
    >>> o.shape, lse.shape
    (torch.Size([5, 2, 8]), torch.Size([5, 2]))
    """
    states = {"o": o, "lse": lse}
    if extra is not None:
        if not isinstance(extra, (tuple, list)) or len(extra) != 2:
            raise ValueError(f"expected extra = (o (T, H, Dv), lse (T, H)), got {type(extra).__name__}")
        states.update({"extra[0]": extra[0], "extra[1]": extra[1]})
    _check_floats(out_dtype, **states)
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(
            f"expected o: (K, T, H, Dv) and lse: (K, T, H) = {tuple(o.shape[:3])}, "
            f"got o {tuple(o.shape)} and lse {tuple(lse.shape)}"
        )
    out_dtype = out_dtype or o.dtype
    if extra is not None:
        if extra[0].shape != o.shape[1:] or extra[1].shape != lse.shape[1:]:
            raise ValueError(
                f"expected extra = (o (T, H, Dv) = {tuple(o.shape[1:])}, lse (T, H) = {tuple(lse.shape[1:])}), "
                f"got {[tuple(x.shape) for x in extra]}"
            )
        o = torch.cat([o.float(), extra[0].float()[None]])
        lse = torch.cat([lse.float(), extra[1].float()[None]])
    lse = lse.float()
    merged_lse, w = lse_weights(lse)
    # An empty state's o may be garbage (some kernels write NaN): it is left out. A NaN lse is
    # not empty: it reaches the output as NaN rather than hiding as a weight of 0.
    merged = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, o.float() * w.unsqueeze(-1)).sum(dim=0)
    return merged.to(out_dtype), merged_lse


def merge_state(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states over disjoint key sets.

    o_a, o_b: (T, H, Dv) any float dtype.
    lse_a, lse_b: (T, H) float32, natural log.
    returns: o (T, H, Dv) out_dtype (default o_a's dtype), lse (T, H) float32.

    >>> o, lse = merge_state(torch.randn(5, 2, 8), torch.randn(5, 2),
    ...                      torch.randn(5, 2, 8), torch.randn(5, 2))
    >>> o.shape, lse.shape
    (torch.Size([5, 2, 8]), torch.Size([5, 2]))
    """
    _check_floats(out_dtype, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != o_a.shape[:2]:
        raise ValueError(
            f"expected o_a, o_b: (T, H, Dv) alike and lse_a, lse_b: (T, H); got o_a "
            f"{tuple(o_a.shape)}, o_b {tuple(o_b.shape)}, lse_a {tuple(lse_a.shape)}, "
            f"lse_b {tuple(lse_b.shape)}"
        )
    return merge_states(
        torch.stack([o_a.float(), o_b.float()]),
        torch.stack([lse_a.float(), lse_b.float()]),
        out_dtype=out_dtype or o_a.dtype,
    )


def merge_state_(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In-place :func:`merge_state`: (o_a, lse_a) becomes the merged state.

    o_a: (T, H, Dv) any float dtype, lse_a: (T, H) float32 (both written); o_b: (T, H, Dv) any float dtype,
    lse_b: (T, H) float32.
    """
    _check_floats(None, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if lse_a.dtype != torch.float32:
        raise ValueError(f"expected lse_a float32 (written in place), got {lse_a.dtype}")
    o, lse = merge_state(o_a, lse_a, o_b, lse_b)
    o_a.copy_(o)
    lse_a.copy_(lse)
