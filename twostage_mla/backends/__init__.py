"""Kernel backends behind the two passes, and the registry that picks one.

Dispatch walks ``_REGISTRY`` in priority order and takes the first backend
with no reasons against it; when none fits, the error lists every refusal.
A backend the user names is checked the same way.
"""

from __future__ import annotations

from twostage_mla.backends.base import AttentionBackend, AttentionSpec, State
from twostage_mla.backends.reference import ReferenceBackend

__all__ = ["AttentionBackend", "AttentionSpec", "State", "backend_names", "refusals", "select_backend"]

# Priority order: fastest first; the reference last, since it runs everywhere.
_REGISTRY: list[type[AttentionBackend]] = [ReferenceBackend]


def backend_names() -> list[str]:
    return [b.name for b in _REGISTRY]


def refusals(spec: AttentionSpec) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve ``spec`` (empty: it can)."""
    return {b.name: b.not_supported_reasons(spec) for b in _REGISTRY}


def select_backend(spec: AttentionSpec, name: str = "auto") -> type[AttentionBackend]:
    """The backend class for ``spec``: the first that fits, or the one named."""
    if name != "auto" and name not in backend_names():
        raise ValueError(f"expected backend to be 'auto' or one of {backend_names()}, got {name!r}")
    candidates = [b for b in _REGISTRY if name in ("auto", b.name)]
    why = {b.name: b.not_supported_reasons(spec) for b in candidates}
    for b in candidates:
        if not why[b.name]:
            return b
    lines = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in why.items())
    what = "no backend fits" if name == "auto" else f"backend {name!r} cannot serve"
    raise ValueError(f"{what} {spec.summary()}:\n{lines}")

