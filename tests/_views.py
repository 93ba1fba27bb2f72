"""Views of other layouts, holding the same values: what an engine may pass instead of a fresh tensor."""

from __future__ import annotations

import torch


def strided_last(x: torch.Tensor | None) -> torch.Tensor | None:
    """The same values with stride 2 in the last dim."""
    if x is None:
        return None
    buf = torch.zeros(*x.shape, 2, dtype=x.dtype, device=x.device)
    buf[..., 0] = x
    return buf[..., 0]


def strided_pages(c: torch.Tensor | None) -> torch.Tensor | None:
    """The same cache as one layer of a (P, layers, page, H_kv, D) buffer (the others NaN): strided in pages."""
    if c is None:
        return None
    big = torch.full((c.shape[0], 3, *c.shape[1:]), float("nan"), dtype=c.dtype, device=c.device)
    big[:, 1] = c
    return big[:, 1]
