"""Model-level proof: transformers' DeepSeek-V3 decoding under DCP through the two-stage split.

A tiny random-weight DeepSeek-V3 (yarn rope, MLA with q/kv LoRA, MoE) from
transformers; its attention replaced by absorbed MLA over a latent cache
sharded on N gloo ranks (examples/mla_dcp.py). For N in {1, 2, 4} and
I in {1, 4}, chains and trees, a2a and ag_rs: greedy speculative decoding must
give exactly transformers' ``generate``; every logit we compute (chunked
prefill with context, verified chains, draft trees) must match transformers'
forward with the matching mask; each layer's attention in a verify step must
match the float64 oracle; the shards must hold transformers' latent cache.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")  # 5.0 keeps expanded K/V, not latents; 5.17 and 5.24 ran

import deepseek_v3_dcp as ex  # noqa: E402
import mla_dcp  # noqa: E402

from twostage_mla import DCPLayout  # noqa: E402

MAX_NEW = 20
PAGE = 8
# Each case runs on every N; together they cover I in {1, 4} x {chain, tree} x {a2a, ag_rs}.
CASES = [
    dict(interleave=1, combine="a2a", q_len=4, tree=None, chunk=16),
    dict(interleave=4, combine="ag_rs", q_len=3, tree=None, chunk=11),
    dict(interleave=1, combine="ag_rs", tree=ex.TREE, chunk=16),
    dict(interleave=4, combine="a2a", tree=ex.TREE, chunk=9),
]


@pytest.fixture(scope="module")
def setup():
    model = ex.build_model(0)
    prompts = ex.make_prompts(model.config.vocab_size, [37, 23], seed=0)
    refs = ex.hf_generate(model, prompts, MAX_NEW)
    return model, prompts, refs


def test_softmax_scale_is_the_models():
    # DeepSeek-V3's real attention dimensions and yarn parameters: 192 ** -0.5 * mscale ** 2.
    cfg = ex.tiny_config(**ex.REAL_DIMS)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rope_parameters["factor"]) == (128, 64, 40.0)
    mscale = 0.1 * math.log(40.0) + 1.0
    assert mla_dcp.softmax_scale(cfg) == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert mla_dcp.softmax_scale(cfg) == pytest.approx(0.13523, abs=1e-5)
    assert mla_dcp.softmax_scale(ex.tiny_config(rope_parameters=None)) == pytest.approx(32**-0.5)


def test_step_mask_worked_example():
    # Context of 2, then a root with two children: rows see the context and their ancestors.
    vis = ex.step_mask(2, [-1, 0, 0])[0, 0] == 0
    assert vis.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]


def test_reference_with_tree_mask_matches_plain_forward(setup):
    # The 4D-mask reference used below agrees with transformers' ordinary causal forward.
    model, prompts, _ = setup
    ctx, step = prompts[0][:20], prompts[0][20:26]
    with torch.no_grad():
        plain = model(torch.tensor([ctx + step])).logits[0, 20:]
        # A chain as a tree: parents j - 1.
        rec = ex.StepRecord(0, "chain", ctx, step, list(range(-1, 5)), torch.empty(0))
        torch.testing.assert_close(ex.reference_logits(model, rec), plain, rtol=1e-5, atol=1e-5)
        # A tree: node 3's path is root -> 1 -> 3, i.e. the chain step[0], step[1], step[3].
        rec = ex.StepRecord(0, "tree", ctx, step, [-1, 0, 0, 1, 1, 2], torch.empty(0))
        path = model(torch.tensor([ctx + [step[0], step[1], step[3]]])).logits[0, -1]
        torch.testing.assert_close(ex.reference_logits(model, rec)[3], path, rtol=1e-5, atol=1e-5)


def test_rows_whose_router_chose_other_experts_can_be_left_out(setup):
    # 16-bit runs leave out the rows where a near-tie tipped the MoE router to other experts than
    # transformers' (their logits differ wholly); every other row still counts, and float32 keeps all.
    model, prompts, _ = setup
    ctx, step = prompts[0][:20], prompts[0][20:26]
    rec = ex.StepRecord(0, "chain", ctx, step, list(range(-1, 5)), torch.empty(0))
    with ex.moe_experts(model) as picks:
        ref = ex.reference_logits(model, rec)
    assert len(picks) == 1 and picks[0].shape == (26, model.config.num_experts_per_tok)  # layer 1 is MoE
    experts = picks[0][20:, None].clone()  # (q, MoE layers, k)
    logits = ref.clone()
    logits[2] += 10 * ref.abs().max()
    experts[2, 0, 0] = (experts[2, 0, 0] + 1) % model.config.n_routed_experts  # another expert for row 2
    rec = ex.StepRecord(0, "chain", ctx, step, list(range(-1, 5)), logits, experts)
    assert ex.logits_error(model, [rec])[0]["chain"] > 5
    err, skipped = ex.logits_error(model, [rec], skip_other_experts=True)
    assert err["chain"] < 1e-5 and skipped == 1
    logits[3] += 1.0  # a row whose experts agree still counts
    err, skipped = ex.logits_error(model, [rec], skip_other_experts=True)
    assert err["chain"] > 1e-2 and skipped == 1


def test_a_model_without_moe_layers_decodes_and_counts_every_row():
    # No router to hook: the steps record no experts, and every row counts.
    model = ex.build_model(0, first_k_dense_replace=2)  # both layers dense
    prompts = ex.make_prompts(model.config.vocab_size, [19], seed=1)
    refs = ex.hf_generate(model, prompts, 6)
    res = ex.decode(model, DCPLayout(1, 0, 1), None, prompts, refs, max_new_tokens=6, page_size=PAGE)
    assert res.tokens == refs
    assert all(rec.experts is None for rec in res.records)
    errs, skipped = ex.logits_error(model, res.records, skip_other_experts=True)
    assert skipped == 0 and max(errs.values()) < 1e-4


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dcp_decoding_matches_transformers(setup, world):
    model, prompts, refs = setup
    cases = [
        dict(c, prompts=prompts, references=refs, max_new_tokens=MAX_NEW, page_size=PAGE, seed=0, trace_steps=1)
        for c in CASES
    ]
    results = ex.run_on_ranks(world, cases)  # results[rank][case]
    scale = model.model.layers[0].self_attn.scaling
    for i, case in enumerate(CASES):
        what = f"N={world} {case}"
        res = results[0][i]
        # 1. greedy speculative decoding = transformers' generate, on every rank
        for r in range(world):
            assert results[r][i].tokens == refs, what
        assert 0 < res.accepted < MAX_NEW * len(prompts), what  # some drafts accepted, some rejected
        # 2. every logit we computed = transformers' forward with the matching mask
        kinds = {rec.kind for rec in res.records}
        assert kinds == {"prefill", "chain" if case["tree"] is None else "tree"}, what
        assert any(rec.kind == "prefill" and rec.context and len(rec.input_ids) > 1 for rec in res.records), what
        # (in float32 our MoE routers choose transformers' experts on every row: none left out)
        errs, skipped = ex.logits_error(model, res.records, skip_other_experts=True)
        assert skipped == 0, f"{what}: {skipped} rows with other experts than transformers'"
        for kind, err in errs.items():
            assert err < 1e-4, f"{what}: {kind} logits rel err {err:.2e}"
        for r in range(world):
            # 3. each layer's attention in a verify step (tree mask included) = the float64 oracle
            err = ex.oracle_error(model, results[r][i].traces[0], scale)
            assert err < 5e-5, f"{what} rank {r}: attention vs oracle rel err {err:.2e}"
            # 4. the shard holds transformers' own latent cache at the positions this rank owns
            err = ex.shard_error(model, results[r][i], DCPLayout(world, r, case["interleave"]), PAGE)
            assert err < 1e-4, f"{what} rank {r}: shard vs transformers' cache abs err {err:.2e}"


def test_bad_options_are_refused_by_name(monkeypatch, capsys):
    for argv, msg in (
        (["--q-len", "0"], "expected --q-len >= 1, got 0"),
        (["--page-size", "6", "--interleave", "4"], "expected --page-size a multiple of --interleave = 4, got 6"),
        (["--tree", "--q-len", "2"], "expected --q-len or --tree, not both (the tree verifies 8 tokens a step)"),
        (["--seed", str(2**64 - 1)], f"expected 0 <= --seed < 2**32, got {2**64 - 1}"),
    ):
        monkeypatch.setattr(sys, "argv", ["deepseek_v3_dcp.py", *argv])
        with pytest.raises(SystemExit) as e:
            ex.main()
        assert e.value.code == 2 and msg in capsys.readouterr().err
