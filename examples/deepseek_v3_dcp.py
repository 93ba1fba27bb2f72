"""DeepSeek-V3 (transformers' implementation) decoding under DCP with speculative verification.

What an engine does, end to end, on a small random-weight DeepSeek-V3 that
runs on CPUs in seconds:

1. transformers' own forward and ``generate`` (greedy) are the reference;
2. our path (mla_dcp.py): absorbed MLA, the latent cache sharded over N ranks
   with interleave I, the prompts prefilled in chunks (chunked prefill with
   context: large Q through the same split), then speculative verification
   steps of Q tokens (a chain) or a token tree, all through TwoStageAttention;
3. checks: logits against transformers' at every position we computed (in
   16-bit, but where rounding tipped a MoE router to other experts),
   greedy tokens against ``generate``, each layer's attention in a verify step
   against ``oracle_attention`` with the same parents (tree or chain), and the shards against
   transformers' own latent cache.

    python examples/deepseek_v3_dcp.py --world-size 2 --interleave 4 --q-len 4
    python examples/deepseek_v3_dcp.py --world-size 4 --tree

An engine's step, as written in :func:`decode` below::

    plan = model.plan(query_start_loc, seq_lens, requests, parents)   # once per step
    logits, fresh = model.forward(input_ids, positions, plan)           # every layer reuses plan
    accept drafts (greedy); commit the kept latents (trees) and go on

A request's tokens, with ``cached`` of them in the sharded cache::

    tokens:  t0 t1 ...... t_{C-1} | t_C            prompt + accepted tokens
             latents in the cache | the last accepted token: its latent is computed
                                    in the next step together with the drafts
    step:    [t_C, d1, d2, ... d_{Q-1}] at positions C .. C+Q-1 (a chain),
             or t_C and a tree of drafts at positions C + depth
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_dcp import DCPDeepseekV3, LayerTrace  # noqa: E402

from twostage_mla import DCPLayout, oracle_attention  # noqa: E402
from twostage_mla.layout import kv_slots  # noqa: E402

# A draft tree: node 0 is the last accepted token; node i's parent is TREE[i].
# Two candidates for the next token, three at depth 2, two at depth 3.
TREE = (-1, 0, 0, 1, 1, 2, 3, 4)


# --------------------------------------------------------------------------- model


def tiny_config(**overrides) -> DeepseekV3Config:
    """DeepSeek-V3's architecture, shrunk for a CPU: MLA with q/kv LoRA, yarn rope, MoE.

    The real model: hidden 7168, 128 heads, kv_lora_rank 512, rope 64, nope 128,
    v 128, yarn factor 40 with mscale 1. initializer_range is raised so that
    random weights give peaked attention (a wrong mask then shows up).
    """
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 dense MLP, layer 1 MoE
        num_attention_heads=8,  # H_loc = 8 / N heads per rank
        num_key_value_heads=8,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=40 * 64,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
        initializer_range=0.2,
        num_mtp_layers=0,
        eos_token_id=None,  # no early stop: generate always makes max_new_tokens
        attn_implementation="eager",
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


# DeepSeek-V3's attention dimensions (MLP and MoE kept small): for GPUs and the fast kernels.
REAL_DIMS = dict(
    hidden_size=7168,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    intermediate_size=1024,
    moe_intermediate_size=256,
    initializer_range=0.02,
    max_position_embeddings=40 * 4096,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    ),
)


def build_model(seed: int = 0, *, real_dims: bool = False, **overrides) -> DeepseekV3ForCausalLM:
    """The same random weights on every rank (fixed seed), float32, eval mode."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_config(**{**(REAL_DIMS if real_dims else {}), **overrides})).eval()
    model.generation_config.eos_token_id = None
    return model


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one request at a time: prompt + new tokens."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(g[0].tolist())
    return out


# --------------------------------------------------------------------------- drafts


class NoisyOracleDrafter:
    """Stand-in for a draft model or MTP head: the reference continuation, corrupted.

    Each proposed token is the reference's with probability 1 - p_wrong, else a
    random token, so verification accepts some drafts and rejects others.
    Whatever it proposes, the decoded tokens are the verifier's own argmaxes.
    """

    def __init__(self, references: list[list[int]], vocab: int, p_wrong: float = 0.3, seed: int = 0) -> None:
        self.refs, self.vocab, self.p = references, vocab, p_wrong
        self.g = torch.Generator().manual_seed(seed)

    def _token(self, b: int, pos: int, truthful: bool) -> int:
        rand = int(torch.randint(0, self.vocab, (1,), generator=self.g))
        good = truthful and pos < len(self.refs[b]) and float(torch.rand(1, generator=self.g)) >= self.p
        return self.refs[b][pos] if good else rand

    def chain(self, b: int, tokens: list[int], k: int) -> list[int]:
        """k drafts following ``tokens``."""
        return [self._token(b, len(tokens) + i, True) for i in range(k)]

    def tree(self, b: int, tokens: list[int], parents: tuple[int, ...]) -> list[int]:
        """A token for every node of the tree ``parents``; node 0, the root, is tokens[-1]."""
        out = [tokens[-1]]
        on_path = [True]  # node follows the reference so far
        depth = [0]
        for i in range(1, len(parents)):
            p = parents[i]
            first_child = parents.index(p, 1) == i
            depth.append(depth[p] + 1)
            tok = self._token(b, len(tokens) - 1 + depth[i], on_path[p] and first_child)
            pos = len(tokens) - 1 + depth[i]
            on_path.append(on_path[p] and pos < len(self.refs[b]) and tok == self.refs[b][pos])
            out.append(tok)
        return out


def depths(parents: list[int]) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


# --------------------------------------------------------------------------- the engine loop


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # prompt + accepted tokens
    cached: int = 0  # tokens whose latents are in the cache: positions 0 .. cached-1

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new_tokens


@dataclass
class StepRecord:
    """One request's part of one step, enough to recompute it with transformers."""

    request: int
    kind: str  # "prefill", "chain" or "tree"
    context: list[int]  # tokens whose latents were in the cache
    input_ids: list[int]  # the step's tokens
    parents: list[int]  # within the step; -1 = root
    logits: torch.Tensor  # (q, vocab), ours
    experts: torch.Tensor | None = None  # (q, MoE layers, k) the experts each row's MoE router chose, ours


@dataclass
class StepTrace:
    """A whole traced step: inputs of every request and each layer's attention on this rank."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    parents: torch.Tensor
    contexts: list[list[int]]
    layers: list[LayerTrace]


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # prompt + generated, per request
    records: list[StepRecord]
    steps: int
    accepted: int  # drafts accepted
    traces: list[StepTrace]
    cache: list[torch.Tensor]  # this rank's shard, per layer
    block_table: torch.Tensor
    cached: list[int]
    backend: str  # the attention backend the layer picked


def decode(
    model,
    layout: DCPLayout,
    group: dist.ProcessGroup | None,
    prompts: list[list[int]],
    references: list[list[int]],
    *,
    max_new_tokens: int,
    q_len: int = 4,
    tree: tuple[int, ...] | None = None,
    chunk: int = 16,
    page_size: int = 8,
    combine: str = "a2a",
    p_wrong: float = 0.3,
    seed: int = 0,
    trace_steps: int = 0,
) -> DecodeResult:
    """Greedy speculative decoding of every prompt on this rank of the DCP group.

    Each step batches, per unfinished request, either its next prefill chunk
    (at most ``chunk`` tokens, over the context prefilled so far) or one
    verification block: a chain of ``q_len`` tokens, or the draft ``tree``.
    references: drafts come from these (see :class:`NoisyOracleDrafter`).
    trace_steps: record each layer's attention in the first few verify steps.
    """
    vocab = model.config.vocab_size
    extra = q_len if tree is None else len(tree)
    m = DCPDeepseekV3(
        model,
        layout,
        group,
        max_seq_lens=[len(p) + max_new_tokens + extra for p in prompts],
        page_size=page_size,
        combine=combine,
        seed=seed,
    )
    dev = m.device
    drafter = NoisyOracleDrafter(references, vocab, p_wrong, seed)
    reqs = [Request(p, max_new_tokens, list(p)) for p in prompts]
    records, traces, steps, accepted = [], [], 0, 0
    while not all(r.done for r in reqs):
        # ---- schedule: what each active request contributes to this step
        active = [b for b, r in enumerate(reqs) if not r.done]
        ids, pars, kinds = [], [], []
        for b in active:
            r = reqs[b]
            if r.cached < len(r.prompt):
                toks = r.prompt[r.cached : r.cached + chunk]
                par, kind = list(range(-1, len(toks) - 1)), "prefill"
            elif tree is None:
                toks = [r.tokens[-1]] + drafter.chain(b, r.tokens, q_len - 1)
                par, kind = list(range(-1, q_len - 1)), "chain"
            else:
                toks, par, kind = drafter.tree(b, r.tokens, tree), list(tree), "tree"
            ids.append(toks)
            pars.append(par)
            kinds.append(kind)
        is_tree = "tree" in kinds
        q_lens = [len(t) for t in ids]
        ctx = [reqs[b].cached for b in active]
        starts = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([c + q for c, q in zip(ctx, q_lens)], dtype=torch.int32, device=dev)
        positions = torch.tensor([c + d for c, p in zip(ctx, pars) for d in depths(p)], device=dev)
        par_all = torch.tensor([p for par in pars for p in par], device=dev)
        parents = par_all if is_tree else None  # None: causal chains

        # ---- one forward of the whole model: plan once, every layer reuses it
        plan = m.plan(query_start_loc, seq_lens, torch.tensor(active, device=dev), parents)
        trace = [] if len(traces) < trace_steps and "prefill" not in kinds else None
        input_ids = torch.tensor(sum(ids, []), device=dev)
        with moe_experts(model) as picks:
            logits, fresh = m.forward(input_ids, positions, plan, write_cache=not is_tree, trace=trace)
        # One copy a step, as the logits below; a model without MoE layers has no router to compare.
        experts = torch.stack(picks, 1).cpu() if picks else None
        logits = logits.float().cpu()  # what the sampler reads
        if trace is not None:
            contexts = [reqs[b].tokens[: reqs[b].cached] for b in active]
            layers = [LayerTrace(*(x.float().cpu() for x in (t.q, t.kv_new, t.out))) for t in trace]
            traces.append(StepTrace(query_start_loc.cpu(), seq_lens.cpu(), par_all.cpu(), contexts, layers))
        steps += 1

        # ---- accept (greedy) and commit
        rows, req_rows, pos_rows = [], [], []
        for i, b in enumerate(active):
            r, toks, par = reqs[b], ids[i], pars[i]
            lo = starts[i]
            lg = logits[lo : lo + len(toks)]
            target = lg.argmax(-1).tolist()
            picked = None if experts is None else experts[lo : lo + len(toks)]
            rec = StepRecord(b, kinds[i], r.tokens[: r.cached], toks, par, lg.clone(), picked)
            records.append(rec)
            if kinds[i] == "prefill":
                path = list(range(len(toks)))
                if r.cached + len(toks) == len(r.prompt):
                    r.tokens.append(target[-1])  # the first generated token
            else:
                # walk from the root while a child holds the verifier's token
                path = [0]
                while True:
                    nxt = [j for j in range(1, len(toks)) if par[j] == path[-1] and toks[j] == target[path[-1]]]
                    if not nxt:
                        break
                    path.append(nxt[0])
                accepted += len(path) - 1
                r.tokens += [toks[j] for j in path[1:]] + [target[path[-1]]]
                del r.tokens[len(r.prompt) + r.max_new_tokens :]
            rows += [lo + j for j in path]
            req_rows += [b] * len(path)
            pos_rows += [r.cached + k for k in range(len(path))]  # the kept tokens' final positions
            r.cached += len(path)
        if is_tree:
            # Tree tokens were not written during the step (the split never reads
            # the step's own tokens from the cache): write the kept ones now, each
            # at its final position, on the rank that owns it.
            m.commit(fresh, *(torch.tensor(x, device=dev) for x in (rows, req_rows, pos_rows)))
    return DecodeResult(
        [r.tokens for r in reqs],
        records,
        steps,
        accepted,
        traces,
        [c.float().cpu() for c in m.cache.layers],
        m.cache.block_table.cpu(),
        [r.cached for r in reqs],
        m.attn.backend.name,
    )


# --------------------------------------------------------------------------- checks against transformers


def step_mask(context_len: int, parents: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, 1, L, L) additive mask for transformers: causal over the context, the tree over the step.

    Row C + j sees every context position and the step tokens that are j or its ancestors.
    """
    c, q = context_len, len(parents)
    vis = torch.tril(torch.ones(c + q, c + q, dtype=torch.bool))
    vis[c:, c:] = False
    for j, p in enumerate(parents):
        if p >= 0:
            vis[c + j, c:] = vis[c + p, c:]
        vis[c + j, c + j] = True
    mask = torch.zeros(c + q, c + q, dtype=dtype).masked_fill(~vis, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def reference_logits(model, rec: StepRecord) -> torch.Tensor:
    """transformers' logits for a step: context + step tokens, positions C + depth, tree mask."""
    c = len(rec.context)
    ids = torch.tensor([rec.context + rec.input_ids])
    pos = torch.tensor([list(range(c)) + [c + d for d in depths(rec.parents)]])
    out = model(input_ids=ids, position_ids=pos, attention_mask=step_mask(c, rec.parents))
    return out.logits[0, c:]


@contextmanager
def moe_experts(model) -> Iterator[list[torch.Tensor]]:
    """The experts each MoE layer's router chose in the forwards run inside: per call (rows, k), sorted."""
    picks: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda mod, args, out: picks.append(out[-1].sort(-1).values)) for g in gates]
    try:
        yield picks
    finally:
        for h in hooks:
            h.remove()


def logits_error(model, records: list[StepRecord], *, skip_other_experts: bool = False) -> tuple[dict[str, float], int]:
    """Max relative error (max |ours - ref| / max |ref|) over the records, by kind, and the rows left out.

    skip_other_experts: leave out the rows whose MoE router chose other experts
    than transformers' (16-bit only: a near-tie that rounding tips, after which
    the row's MoE output, and so its logits, differ wholly; session 58 found
    transformers' own bf16 forward flipping the same rows).
    """
    err: dict[str, float] = {}
    skipped = 0
    for rec in records:
        compare = skip_other_experts and rec.experts is not None
        with moe_experts(model) if compare else nullcontext([]) as picks:  # no hooks where nothing compares
            ref = reference_logits(model, rec)
        keep = torch.ones(len(ref), dtype=torch.bool)
        if compare:
            theirs = torch.stack(picks, 1)[-len(ref) :]  # the step's rows (the context's come first)
            keep = (theirs == rec.experts).flatten(1).all(1)
            skipped += int((~keep).sum())
        e = ((rec.logits - ref)[keep].abs().max() / ref.abs().max()).item() if keep.any() else 0.0
        err[rec.kind] = max(err.get(rec.kind, 0.0), e)
    return err, skipped


@torch.no_grad()
def hf_latents(model, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' own latent cache for ``tokens``: per layer (S, 1, R + P) = [kv_a_layernorm(c), roped k_pe]."""
    if not tokens:
        d = model.config.kv_lora_rank + model.config.qk_rope_head_dim
        return [torch.zeros(0, 1, d) for _ in range(model.config.num_hidden_layers)]
    out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return [torch.cat([lay.keys[0, 0], lay.values[0, 0]], dim=-1)[:, None] for lay in cache.layers]


def oracle_error(model, trace: StepTrace, scale: float) -> float:
    """Max relative error of each layer's attention on this rank's heads against the float64 oracle.

    Keys: transformers' latents of each request's context, then the step's own
    latents; the oracle applies the same tree parents.
    """
    ctx = [hf_latents(model, c) for c in trace.contexts]
    qsl = trace.query_start_loc.tolist()
    worst = 0.0
    for li, lt in enumerate(trace.layers):
        kv = torch.cat([t for b in range(len(ctx)) for t in (ctx[b][li], lt.kv_new[qsl[b] : qsl[b + 1]])])
        r = model.config.kv_lora_rank
        o, _ = oracle_attention(lt.q, kv, kv[..., :r], trace.query_start_loc, trace.seq_lens, scale, trace.parents)
        worst = max(worst, ((lt.out.double() - o).abs().max() / o.abs().max()).item())
    return worst


def shard_error(model, res: DecodeResult, layout: DCPLayout, page_size: int) -> float:
    """Max abs difference between this rank's shard and transformers' latent cache, positions it owns."""
    worst = 0.0
    for b, (toks, n) in enumerate(zip(res.tokens, res.cached)):
        n = min(n, len(toks))  # the last step may have gone past max_new_tokens
        ref = hf_latents(model, toks[:n])
        slots = kv_slots(torch.arange(n), torch.full((n,), b), res.block_table, page_size, layout)
        keep = slots >= 0
        for cache, lat in zip(res.cache, ref):
            got = cache.view(-1, *cache.shape[2:])[slots[keep]]
            worst = max(worst, (got - lat[keep]).abs().max().item() if keep.any() else 0.0)
    return worst


# --------------------------------------------------------------------------- launching N ranks


def _rank_main(rank: int, world: int, init: str, out_dir: str, model: dict, cases: list[dict]) -> None:
    cuda = model.get("device", "cpu") == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # N ranks share the CPUs (and a forked child must not reuse the parent's OpenMP pool)
    if world > 1:
        gpu = torch.device("cuda", rank) if cuda else None  # binds NCCL to this rank's GPU
        name = "nccl" if cuda else "gloo"
        dist.init_process_group(name, init_method=init, rank=rank, world_size=world, device_id=gpu)
    try:
        # every rank: the same weights
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dtype = getattr(torch, model.get("dtype", "float32"))
        model = build_model(model.get("seed", 0), real_dims=model.get("real_dims", False)).to(device=dev, dtype=dtype)
        results = []
        for kw in cases:
            kw = dict(kw)
            layout = DCPLayout(world, rank, kw.pop("interleave"))
            results.append(decode(model, layout, dist.group.WORLD if world > 1 else None, **kw))
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        if world > 1:
            dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_on_ranks(world: int, cases: list[dict], *, model: dict | None = None, start_method: str | None = None) -> list:
    """:func:`decode` of every case (its keyword arguments and ``interleave``) on ``world`` processes.

    model: build options, {"seed": 0, "real_dims": False, "device": "cpu" | "cuda", "dtype": "float32"};
    gloo on CPUs, NCCL with one GPU per rank. returns results[rank][case].
    start_method: "fork" for CPUs where the platform has it (the children
    inherit the imported transformers; "spawn" imports it again in every
    process, seconds each), else "spawn". N == 1 on CPUs runs here.
    """
    model = dict(model or {})
    cuda = model.get("device", "cpu") == "cuda"
    if start_method is None:
        # A process that has started CUDA runs its driver threads, and forking
        # a multi-threaded process may deadlock the child (Python warns).
        can_fork = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
        start_method = "fork" if can_fork and not cuda else "spawn"
    with tempfile.TemporaryDirectory() as out_dir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        if world == 1 and not cuda:
            threads = torch.get_num_threads()
            try:
                _rank_main(0, 1, init, out_dir, model, cases)
            finally:
                torch.set_num_threads(threads)
        else:
            args = (world, init, out_dir, model, cases)
            mp.start_processes(_rank_main, args=args, nprocs=world, start_method=start_method)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2, help="N, ranks of the DCP group")
    ap.add_argument("--interleave", type=int, default=1, help="I, consecutive tokens per rank")
    ap.add_argument("--q-len", type=int, default=None, help="tokens per verification step (chain; default 4)")
    ap.add_argument("--tree", action="store_true", help=f"verify a draft tree {TREE} instead of a chain")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (Q of a prefill step)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[37, 23])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--combine", choices=("a2a", "ag_rs"), default="a2a")
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument("--real-dims", action="store_true", help="DeepSeek-V3's attention dimensions (128 heads, 512+64)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.tree and a.q_len is not None:  # the tree sets the step's tokens itself
        ap.error(f"expected --q-len or --tree, not both (the tree verifies {len(TREE)} tokens a step)")
    a.q_len = 4 if a.q_len is None else a.q_len
    if not 0 <= a.seed < 2**32:  # ranks seed seed + 1000 x rank: far from the generator's 64-bit limit
        ap.error(f"expected 0 <= --seed < 2**32, got {a.seed}")
    for name in ("world_size", "interleave", "q_len", "chunk", "max_new_tokens", "page_size"):
        if getattr(a, name) < 1:
            ap.error(f"expected --{name.replace('_', '-')} >= 1, got {getattr(a, name)}")
    if min(a.prompt_lens) < 1:
        ap.error(f"expected --prompt-lens >= 1 each, got {a.prompt_lens}")
    if a.page_size % a.interleave:
        ap.error(f"expected --page-size a multiple of --interleave = {a.interleave}, got {a.page_size}")
    heads = tiny_config(**(REAL_DIMS if a.real_dims else {})).num_attention_heads
    if heads % a.world_size:  # each rank keeps heads / N of them (tensor parallel)
        ap.error(f"expected --world-size to divide the model's {heads} attention heads, got {a.world_size}")
    if a.device == "cuda" and torch.cuda.device_count() < a.world_size:
        ap.error(f"expected --device cuda with at least --world-size = {a.world_size} GPUs, "
                 f"found {torch.cuda.device_count()}")  # fmt: skip

    # The reference: transformers in float32 on the CPU, with the weights the ranks use
    # (rounded to --dtype first, so that only the arithmetic differs).
    model = build_model(a.seed, real_dims=a.real_dims).to(getattr(torch, a.dtype)).float()
    prompts = make_prompts(model.config.vocab_size, a.prompt_lens, a.seed)
    refs = hf_generate(model, prompts, a.max_new_tokens)
    case = dict(
        interleave=a.interleave,
        prompts=prompts,
        references=refs,
        max_new_tokens=a.max_new_tokens,
        q_len=a.q_len,
        tree=TREE if a.tree else None,
        chunk=a.chunk,
        page_size=a.page_size,
        combine=a.combine,
        seed=a.seed,
        trace_steps=1,
    )
    opts = dict(seed=a.seed, real_dims=a.real_dims, device=a.device, dtype=a.dtype)
    results = [r[0] for r in run_on_ranks(a.world_size, [case], model=opts)]
    res = results[0]
    mode = f"tree {TREE}" if a.tree else f"chain of Q={a.q_len}"
    dims = "DeepSeek-V3 attention dims" if a.real_dims else "tiny"
    print(
        f"DeepSeek-V3 ({dims}, random weights), DCP N={a.world_size} I={a.interleave}, {mode}, {a.combine}, "
        f"{a.dtype} on {a.device}, backend {res.backend}"
    )
    print(f"  {res.steps} steps, {res.accepted} drafts accepted")
    # Beyond the tokens (a wrong attention can still pick them), every error has a bound: float32
    # rounding, or in 16-bit the model's own drift from transformers' float32 (docs/model_integration.md).
    tol = 1e-4 if a.dtype == "float32" else 1e-1
    errors = {}
    logit_errors, skipped = logits_error(model, res.records, skip_other_experts=a.dtype != "float32")
    for kind, e in logit_errors.items():
        print(f"  logits vs transformers, {kind:8s} steps: max rel err {e:.2e}")
        errors[f"logits ({kind})"] = e
    rows = sum(len(rec.input_ids) for rec in res.records)
    if skipped:
        print(f"    ({skipped} of {rows} rows left out: their MoE router chose other experts than transformers')")
    # A tipped near-tie is rare (session 58: <= 2 of 136 rows); many would mean drift beyond rounding.
    too_many_flips = skipped > rows // 10
    scale = model.model.layers[0].self_attn.scaling
    for r, rr in enumerate(results):
        e_attn = oracle_error(model, rr.traces[0], scale) if rr.traces else None
        e_shard = shard_error(model, rr, DCPLayout(a.world_size, r, a.interleave), a.page_size)
        attn_text = "no verify step traced" if e_attn is None else f"max rel err {e_attn:.2e}"
        print(
            f"  rank {r}: attention vs oracle (traced step) {attn_text}, "
            f"shard vs transformers' latent cache max abs err {e_shard:.2e}"
        )
        if e_attn is not None:
            errors[f"rank {r} attention"] = e_attn
        if a.dtype == "float32":  # 16-bit latents differ from transformers' float32 ones by rounding
            errors[f"rank {r} shard"] = e_shard
    same = all(rr.tokens == refs for rr in results)
    print(f"  greedy tokens equal transformers' generate on every rank: {same}")
    if not same:
        agree = [
            next((i for i, (x, y) in enumerate(zip(t, ref)) if x != y), len(t)) - len(p)
            for t, ref, p in zip(res.tokens, refs, prompts)
        ]
        print(f"  generated tokens equal to transformers' before the first difference, per request: {agree}")
    over = [f"{name} {e:.2e}" for name, e in errors.items() if not e <= tol]
    if over:
        print(f"  FAILED: errors above {tol:.0e} ({a.dtype}): {', '.join(over)}")
    if too_many_flips:
        print(f"  FAILED: more than a tenth of the rows ({skipped} of {rows}) chose other experts than transformers'")
    if over or too_many_flips or (not same and a.dtype == "float32"):  # in 16-bit a near-tie may flip a token
        sys.exit(1)


if __name__ == "__main__":
    main()
