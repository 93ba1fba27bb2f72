"""``twostage-mla check``: every backend this machine can run, against the oracle.

One process, N = 1 (the kernels do not depend on N: a rank's shard is just a
paged cache with shorter lengths; ``twostage-mla demo`` checks the collectives).
For each backend that can serve MLA or GQA on the device, runs the whole
layer over a small mixed batch and reports the error against float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twostage_mla import synthetic
from twostage_mla.backends import backend_names, refusals
from twostage_mla.layer import AttentionConfig, TwoStageAttention
from twostage_mla.layout import DCPLayout

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip

# (label, config): small but real head dims, MLA at DeepSeek's 576/512.
SHAPES = [
    ("mla 576/512", AttentionConfig.mla(num_heads=16, kv_lora_rank=512, rope_dim=64, page_size=64, scale=576**-0.5)),
    ("gqa 128", AttentionConfig(8, 128, 128, 16, 128**-0.5, num_kv_heads=2, kv_format="gqa")),
]


def run_check(
    device: str = "auto", dtypes: tuple[str, ...] = (), on_row: Callable[[dict], None] | None = None
) -> list[dict]:
    """Rows of (backend, shape, dtype, max_rel_err, ok | reason skipped).

    ``on_row`` sees each row as soon as it is known: on a GPU each backend's
    first layer can take ~20 s to load its compiled kernels, so the command
    line prints rows as they come rather than all at the end.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"expected --device auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("expected --device cuda only where torch.cuda.is_available(), which is False here")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"expected --dtype in {sorted(DTYPES)}, got {d!r}")
    names = list(dict.fromkeys(DTYPES[d] for d in dtypes)) or (  # a dtype given twice runs once
        [torch.bfloat16, torch.float16] if dev.type == "cuda" else [torch.float32, torch.bfloat16]
    )
    ctx, ql = [0, 5, 700, 1500], [3, 1, 8, 4]  # an empty context, short, longer; q_len 1..8
    rows = []
    for label, cfg in SHAPES:
        mla = cfg.kv_format == "mla"
        for dtype in names:
            step = synthetic.make_step(
                ctx, ql, heads=cfg.num_heads, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                kv_heads=cfg.num_kv_heads, mla=mla, dtype=dtype, seed=1,
            )  # fmt: skip
            ref, _ = synthetic.oracle(step, cfg.scale)
            x = synthetic.rank_inputs(step, DCPLayout(), cfg.page_size, mla=mla, dtype=dtype, device=dev)
            probe = TwoStageAttention(cfg, DCPLayout(), dtype=dtype, device=dev, backend="reference").spec
            why = refusals(probe)
            for name in backend_names():
                row = {"backend": name, "shape": label, "dtype": str(dtype).removeprefix("torch.")}
                if why[name]:
                    rows.append({**row, "status": "skipped: " + "; ".join(why[name])})
                else:
                    rows.append(_run_one(name, cfg, dtype, dev, x, ref, row))
                if on_row is not None:
                    on_row(rows[-1])
    return rows


def verdict(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, bool]:
    """(max_abs_err, max_rel_err, ok) of out (any shape, any device) against ref, the float64 oracle's.

    ok: max_rel_err within TOLERANCE[dtype]; a NaN anywhere in out fails (its error is NaN).
    """
    err = (out.double().cpu() - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    return err, rel, rel <= TOLERANCE[dtype]  # NaN compares False


def _run_one(name: str, cfg: AttentionConfig, dtype: torch.dtype, dev: torch.device, x, ref, row: dict) -> dict:
    attn = TwoStageAttention(cfg, DCPLayout(), dtype=dtype, device=dev, backend=name)
    out = attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
    _, rel, ok = verdict(out, ref, dtype)
    return {**row, "max_rel_err": rel, "status": "ok" if ok else f"FAIL (> {TOLERANCE[dtype]})"}


HEADER = f"{'backend':<16}{'shape':<14}{'dtype':<10}{'max_rel_err':>12}  status"


def format_row(r: dict) -> str:
    err = f"{r['max_rel_err']:.2e}" if "max_rel_err" in r else "-"
    return f"{r['backend']:<16}{r['shape']:<14}{r['dtype']:<10}{err:>12}  {r['status']}"
