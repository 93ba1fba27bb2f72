"""A transformers DeepSeek-V3 model whose attention runs through TwoStageAttention.

Only attention is replaced. Embeddings, norms, the dense MLP / MoE and the LM
head are transformers' own modules, called as they are; the attention of each
layer is rewritten the way serving engines run MLA at decode time:

    x (T, hidden) -> q_a_proj -> q_a_layernorm -> q_b_proj -> q (T, H, nope + rope)
                  -> kv_a_proj_with_mqa -> (c (T, R), k_pe (T, P))
    c    = kv_a_layernorm(c)                          the latent, R = kv_lora_rank
    q_pe, k_pe = rope(q_pe, k_pe) at each token's position
    q_abs  = [q_nope @ W_UK , q_pe]    (T, H, R + P)  W_UK absorbed into the query
    kv_new = [c , k_pe]                (T, 1, R + P)  what the cache stores per token
    o_lat  = TwoStageAttention(q_abs, kv_new, cache)  (T, H, R)   V = first R values of K
    o      = o_lat @ W_UV^T            (T, H, v)      W_UV applied after attention
    out    = o_proj(o)                 (T, hidden)

with W_UK, W_UV the two halves of kv_b_proj's weight, per head. The scores
q_abs . kv = q_nope . (W_UK c) + q_pe . k_pe equal the model's
q_nope . k_nope + q_pe . k_pe, so the softmax scale is the model's own:
1/sqrt(qk_nope + qk_rope) times yarn's mscale squared, NOT 1/sqrt(R + P).

Tensor parallelism: rank r of the DCP group (here also the TP group) owns
heads r*H_loc .. (r+1)*H_loc-1. This file computes q for every head and keeps
its own (an engine shards q_b_proj column-wise instead), and all-gathers the
attention output heads before the unsharded o_proj (an engine shards o_proj
row-wise and all-reduces). Both keep every rank's hidden states identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from twostage_mla import AttentionConfig, DCPLayout, StepPlan, TwoStageAttention
from twostage_mla.layout import kv_slots, local_pages

# torch >= 2.12 names it all_gather_single; older releases only all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def softmax_scale(config) -> float:
    """The model's softmax scale: qk_head_dim ** -0.5, times mscale**2 under yarn.

    qk_head_dim = qk_nope_head_dim + qk_rope_head_dim (192 for DeepSeek-V3),
    the width of the un-absorbed q and k. With yarn rope scaling and
    ``mscale_all_dim`` set, mscale = 0.1 * mscale_all_dim * ln(factor) + 1
    (DeepSeek-V3: factor 40, mscale_all_dim 1 -> mscale 1.3689, scale 0.13523).
    """
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def absorbed_weights(attn: hf.DeepseekV3Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK (H, qk_nope, R) and W_UV (H, v, R): kv_b_proj's weight split per head.

    kv_b_proj maps the latent c (R) to [k_nope (qk_nope), v (v)] for each of the
    H heads: weight (H * (qk_nope + v), R), head-major.
    """
    nope, v = attn.qk_nope_head_dim, attn.v_head_dim
    w = attn.kv_b_proj.weight.view(attn.num_heads, nope + v, attn.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def apply_rope(config, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The model's rope on q_pe (T, H, P) and k_pe (T, 1, P); cos, sin (T, P)."""
    fn = hf.apply_rotary_pos_emb_interleave if config.rope_interleave else hf.apply_rotary_pos_emb
    return fn(q_pe, k_pe, cos, sin, unsqueeze_dim=1)


class PagedLatentCache:
    """This rank's paged latent cache: one (P, page_size, 1, R + P) tensor per layer.

    Every layer shares one block table: request b's local slot li is page
    ``block_table[b, li // page_size]``, offset ``li % page_size``. Pages are
    handed out in a random order (so a kernel that ignores the table shows up)
    and start filled with noise (so one that reads past a request's length does).
    """

    def __init__(
        self,
        num_layers: int,
        max_seq_lens: list[int],
        layout: DCPLayout,
        page_size: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        n, r, i = layout.world_size, layout.rank, layout.interleave
        pages = [local_pages(s, n, i, r, page_size) for s in max_seq_lens]
        total = max(sum(pages), 1)
        g = torch.Generator().manual_seed(seed + 1000 * r)
        order = torch.randperm(total, generator=g)
        # The same width on every rank: what rank 0 (the rank holding the most) needs.
        width = max(max(local_pages(s, n, i, 0, page_size) for s in max_seq_lens), 1)
        table = torch.full((len(pages), width), -1, dtype=torch.int32)  # -1: a page this rank does not use
        used = 0
        for b, p in enumerate(pages):
            table[b, :p] = order[used : used + p].to(torch.int32)
            used += p
        self.block_table = table.to(device)  # (B, max_pages) int32
        self.layers = [
            (torch.randn(total, page_size, 1, dim, generator=g) * 10).to(dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.layout, self.page_size = layout, page_size

    def slots(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(K,) flat slot of each (request, position) on this rank, -1 where another rank owns it."""
        return kv_slots(positions, requests, self.block_table, self.page_size, self.layout)


@dataclass
class LayerTrace:
    """What one layer's attention saw and returned in a traced step (this rank's heads)."""

    q: torch.Tensor  # (T, H_loc, R + P) absorbed queries
    kv_new: torch.Tensor  # (T, 1, R + P) the step's latents
    out: torch.Tensor  # (T, H_loc, R) attention output, before W_UV


class DCPDeepseekV3:
    """A DeepseekV3ForCausalLM run on one rank of a DCP group, attention via the two-stage split.

    model: transformers' DeepseekV3ForCausalLM (every rank holds the same weights).
    layout: (N, r, I); group: the DCP process group (None when N == 1).
    max_seq_lens: capacity of each request (row of the block table), in tokens.

    Per step: ``plan = m.plan(query_start_loc, seq_lens, requests, parents)``,
    then ``logits, fresh = m.forward(input_ids, positions, plan)``.
    """

    def __init__(
        self,
        model,
        layout: DCPLayout,
        group: dist.ProcessGroup | None,
        *,
        max_seq_lens: list[int],
        page_size: int = 16,
        combine: str = "a2a",
        backend: str = "auto",
        seed: int = 0,
    ) -> None:
        cfg = model.config
        n = layout.world_size
        if cfg.num_attention_heads % n:
            raise ValueError(f"expected num_attention_heads divisible by N = {n}, got {cfg.num_attention_heads}")
        self.model, self.cfg, self.layout, self.group = model, cfg, layout, group
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.h_loc = cfg.num_attention_heads // n
        self.heads = slice(layout.rank * self.h_loc, (layout.rank + 1) * self.h_loc)
        self.scale = softmax_scale(cfg)
        for layer in model.model.layers:  # the scale the model itself uses
            if not math.isclose(layer.self_attn.scaling, self.scale, rel_tol=1e-12):
                raise ValueError(f"softmax scale {self.scale} differs from the model's {layer.self_attn.scaling}")
        # Absorbed weights of this rank's heads, once per model.
        self.w_uk, self.w_uv = [], []
        for layer in model.model.layers:
            uk, uv = absorbed_weights(layer.self_attn)
            self.w_uk.append(uk[self.heads])  # (H_loc, nope, R)
            self.w_uv.append(uv[self.heads])  # (H_loc, v, R)
        r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        # One layer object serves every layer: same shapes, same plan.
        mla = AttentionConfig.mla(
            num_heads=self.h_loc, kv_lora_rank=r, rope_dim=p, page_size=page_size, scale=self.scale
        )
        self.attn = TwoStageAttention(
            mla,
            layout,
            group=group,
            combine=combine,
            backend=backend,
            dtype=self.dtype,
            device=self.device,
        )
        n_layers = cfg.num_hidden_layers
        self.cache = PagedLatentCache(
            n_layers, max_seq_lens, layout, page_size, r + p, dtype=self.dtype, device=self.device, seed=seed
        )

    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        requests: torch.Tensor,
        parents: torch.Tensor | None = None,
    ) -> StepPlan:
        """Per-step plan for the requests (rows of the block table) in this step's batch.

        query_start_loc: (B+1,) int32; seq_lens: (B,) int32, context + the step's tokens;
        requests: (B,) int, which cache rows; parents: optional (T,) tree parents.
        """
        table = self.cache.block_table[requests.long()]
        return self.attn.plan(query_start_loc, seq_lens, table, parents=parents)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: StepPlan,
        *,
        write_cache: bool = True,
        trace: list[LayerTrace] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step of the whole model over the T tokens of the batch.

        input_ids: (T,) int64; positions: (T,) int64, each token's rope position
            (context + index for a chain, context + depth in a tree).
        write_cache: write the latents of the tokens this rank owns (``plan.write_new_tokens``)
            (chains and prefill); with False the caller commits the ones it keeps
            with :meth:`commit` (tree speculation).
        returns logits (T, vocab) and the step's latents, one (T, 1, R + P) per layer.
        """
        m = self.model.model
        h = m.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = m.rotary_emb(h, positions[None])  # (1, T, P) each, yarn attention factor included
        cos, sin = cos[0], sin[0]
        fresh = []
        for i, layer in enumerate(m.layers):
            x = layer.input_layernorm(h)
            o, kv_new = self._attention(i, layer.self_attn, x, cos, sin, plan, write_cache, trace)
            fresh.append(kv_new)
            h = h + o
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h)), fresh

    def _attention(self, i, a, x, cos, sin, plan, write_cache, trace):
        cfg, t = self.cfg, x.shape[0]
        nope, rope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))) if a.q_lora_rank is not None else a.q_proj(x)
        q = q.view(t, cfg.num_attention_heads, nope + rope)[:, self.heads]  # (T, H_loc, nope + rope)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        c, k_pe = a.kv_a_proj_with_mqa(x).split([r, rope], dim=-1)  # (T, R), (T, P)
        c = a.kv_a_layernorm(c)
        q_pe, k_pe = apply_rope(cfg, q_pe, k_pe[:, None], cos, sin)  # (T, H_loc, P), (T, 1, P)

        q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, self.w_uk[i]), q_pe], dim=-1)  # (T, H_loc, R + P)
        kv_new = torch.cat([c[:, None], k_pe], dim=-1)  # (T, 1, R + P)
        cache = self.cache.layers[i]  # (pages, page_size, 1, R + P)
        if write_cache:  # this rank's new tokens into its shard (indices from the plan: no host sync)
            plan.write_new_tokens(cache, kv_new)
        o_lat = self.attn(q_abs, kv_new, None, cache, None, plan)  # (T, H_loc, R)
        if trace is not None:
            trace.append(LayerTrace(q_abs, kv_new, o_lat))

        o = torch.einsum("thr,hvr->thv", o_lat, self.w_uv[i])  # (T, H_loc, v)
        if self.layout.world_size > 1:  # every rank's heads, rank-major = the model's head order
            n = self.layout.world_size
            out = o.new_empty((n * t, *o.shape[1:]))
            _all_gather(out, o.contiguous(), group=self.group)
            o = out.view(n, t, *o.shape[1:]).transpose(0, 1)
        return a.o_proj(o.reshape(t, -1)), kv_new

    @torch.no_grad()
    def commit(
        self, fresh: list[torch.Tensor], rows: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write chosen latents of a step into the cache at the positions they end up at.

        fresh: from :meth:`forward`; rows: (K,) which of its T tokens to keep;
        requests: (K,) their cache rows; positions: (K,) their final positions.
        Every rank holds every token's latent (it was computed from hidden states
        that every rank has), so each rank writes the ones it owns, no exchange.
        """
        slots = self.cache.slots(requests, positions)
        keep = slots >= 0
        for cache, kv in zip(self.cache.layers, fresh):
            cache.view(-1, *kv.shape[1:])[slots[keep]] = kv[rows][keep]


if __name__ == "__main__":  # a module, not a script: say where the runnable example is
    raise SystemExit("examples/mla_dcp.py is the model that examples/deepseek_v3_dcp.py imports; run that one "
                     "(python examples/deepseek_v3_dcp.py --help)")  # fmt: skip
