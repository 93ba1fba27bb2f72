"""The fused query-pass kernel at DeepSeek-V3's dims (128 heads, 576 / 512) against float64, per launch shape.

Session 58 asked whether session 57's rule (steps of <= 32 tokens at 128 heads take the narrow launch)
caused the DeepSeek-V3 example's bfloat16 miss; it did not (the miss was MoE routing: the example's
docstring). This compares the default launch, the narrow and the wide one, each forced, on the
example's step shapes (chunks of 16, chains of 4, mixed) with the float64 oracle.

    PYTHONPATH=$PWD python3 benchmarks/narrow_launch_probe.py
"""

from __future__ import annotations

import torch

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, oracle_attention, synthetic
from twostage_mla.kernels.query_merge import _NARROW_LAUNCH, _WIDE_LAUNCH, _wide_launch, query_merge_triton
from twostage_mla.state import lse_weights


def reference(x: synthetic.RankInputs, v, ctx_o, ctx_lse, scale):
    """Float64, on the CPU: each request's tokens over the step's own keys (the query pass), merged with ctx."""
    qsl = x.query_start_loc
    o, lse = oracle_attention(x.q, x.k, v, qsl, qsl.diff(), scale)  # seq_lens = q_lens: no context keys
    merged_lse, w = lse_weights(torch.cat([ctx_lse.double().cpu(), lse[None]]))
    return (w[..., None] * torch.cat([ctx_o.double().cpu(), o[None]])).sum(0), merged_lse


# (context lens, q lens): the example's steps (prompts 37 and 23 in chunks of 16, then chains of 4), and more.
CASES = [
    ([0, 0], [16, 16]),
    ([16, 16], [16, 7]),
    ([32, 23], [5, 4]),
    ([37, 27], [4, 4]),
    ([45], [4]),
    ([40, 30], [1, 1]),
    ([9], [16]),
    ([0, 5, 9, 2, 7], [3, 1, 16, 6, 9]),
    ([100] * 8, [4] * 8),
    ([60] * 9, [4] * 9),
    ([0, 5, 9, 2, 7], [3, 1, 16, 6, 37]),
]
# The kernel's own default shapes, forced (its constexpr names as query_merge_triton's keywords); the
# narrow one takes MLA's 512 value dims whole, as the default does.
LAUNCHES = {
    "default": {},
    "narrow": {**{k.lower(): v for k, v in _NARROW_LAUNCH.items()}, "block_v": 512},
    "wide": {k.lower(): v for k, v in _WIDE_LAUNCH.items()},
}


def main() -> None:
    h, hk, d, dv = 128, 1, 576, 512
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, slow
    print(torch.cuda.get_device_name(0) if dev == "cuda" else "cpu")
    cases = CASES if dev == "cuda" else CASES[4:5]
    worst = 0.0
    for ctx, q_lens in cases:
        step = synthetic.make_step(ctx, q_lens, heads=h, head_dim=d, head_dim_v=dv, kv_heads=hk, seed=3,
                                   dtype=torch.bfloat16)  # fmt: skip
        x = synthetic.rank_inputs(step, DCPLayout(), 8, mla=True, dtype=torch.bfloat16, device=dev)
        cfg = AttentionConfig(h, d, dv, 8, d**-0.5, hk, "mla")
        attn = TwoStageAttention(cfg, DCPLayout(), dtype=torch.bfloat16, device=dev, backend="reference",
                                 fuse_query=False)  # fmt: skip
        plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        t = x.q.shape[0]
        v = x.k[..., :dv]
        for k_states in (1, 2):
            g = torch.Generator(device=dev).manual_seed(k_states)
            ctx_o = torch.randn(k_states, t, h, dv, device=dev, generator=g).bfloat16()
            ctx_lse = torch.randn(k_states, t, h, device=dev, generator=g) * 3
            ref_o, ref_lse = reference(x, v, ctx_o, ctx_lse, cfg.scale)
            line = []
            for name, kw in LAUNCHES.items():
                o, lse = query_merge_triton(x.q, x.k, v, plan, ctx_o, ctx_lse, scale=cfg.scale,
                                            out_dtype=torch.float32, **kw)  # fmt: skip
                e = ((o.double().cpu() - ref_o).abs().max() / ref_o.abs().max()).item()
                el = (lse.double().cpu() - ref_lse).abs().max().item()
                worst = max(worst, e)
                line.append(f"{name} {e:.1e}/{el:.1e}")
            print(f"q_lens {q_lens} ctx {ctx} T={t} K={k_states} default wide={_wide_launch(t, hk, h)}: "
                  + ", ".join(line))  # fmt: skip
    print(f"worst rel err {worst:.2e}")


if __name__ == "__main__":
    main()
