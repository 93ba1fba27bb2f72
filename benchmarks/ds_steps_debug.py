"""Session 58 debug: the DeepSeek-V3 example's logits and attention errors per step, every verify step traced."""

import sys
import time

import torch

sys.path.insert(0, "examples")
import deepseek_v3_dcp as ex  # noqa: E402


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    for seed in [int(s) for s in sys.argv[2:]] or [0]:
        t0 = time.time()
        model = ex.build_model(seed, real_dims=True).to(getattr(torch, dtype)).float()
        prompts = ex.make_prompts(model.config.vocab_size, [37, 23], seed)
        refs = ex.hf_generate(model, prompts, 12)
        case = dict(
            interleave=4,
            prompts=prompts,
            references=refs,
            max_new_tokens=12,
            q_len=4,
            tree=None,
            chunk=16,
            page_size=8,
            combine="a2a",
            seed=seed,
            trace_steps=99,
        )
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        res = ex.run_on_ranks(1, [case], model=dict(seed=seed, real_dims=True, device=dev, dtype=dtype))[0][0]
        agree = [
            next((i for i, (x, y) in enumerate(zip(t, r)) if x != y), len(t)) - len(p)
            for t, r, p in zip(res.tokens, refs, prompts)
        ]
        print(f"seed {seed}: {res.steps} steps, {res.accepted} accepted, tokens equal before: {agree}")
        for i, rec in enumerate(res.records):
            ref = ex.reference_logits(model, rec)
            row = ((rec.logits - ref).abs().amax(-1) / ref.abs().max()).tolist()
            e = max(row)  # logits_error's figure for this record
            flag = " <<<" if e > 0.05 else ""
            print(
                f"  rec {i} req {rec.request} {rec.kind:7s} ctx {len(rec.context):3d} q {len(rec.input_ids):2d} "
                f"err {e:.2e} rows {' '.join(f'{x:.1e}' for x in row)}{flag}"
            )
        scale = model.model.layers[0].self_attn.scaling
        for j, tr in enumerate(res.traces):
            print(
                f"  trace {j}: contexts {[len(c) for c in tr.contexts]} qsl {tr.query_start_loc.tolist()} "
                f"attention vs oracle {ex.oracle_error(model, tr, scale):.2e}"
            )
        print(f"  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
