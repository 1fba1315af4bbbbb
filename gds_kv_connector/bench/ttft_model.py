"""A Llama-style decoder with a real model's geometry and random bf16 weights, for timing prefill.

Its forward does what a prefill costs: per layer an RMS norm, the QKV projection, rotary positions,
causal attention through ``torch.nn.functional.scaled_dot_product_attention`` (its flash kernel on a
GPU, grouped-query attention by ``enable_gqa``: torch 2.5 or later), the
output projection and a SwiGLU MLP, with each layer's K and V written into a paged KV pool laid out
as TensorRT-LLM's ``[num_blocks, num_layers, 2, kv_heads * tokens_per_block * head_dim]`` (per block
and plane: ``[kv_heads, tokens_per_block, head_dim]``).  Tokens after a prefix already in the pool
(loaded, or computed earlier) attend to it through the pool's pages, as a paged attention kernel
would read them.  A tensor-parallel shard runs its share of heads and MLP without the all-reduces
that would join the shards: its compute is the shard's, its communication is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ROPE_THETA = 500_000.0  # Llama 3
NORM_EPS = 1e-5


@dataclass(frozen=True)
class Geometry:
    """One model (or one tensor-parallel shard of it): what its prefill computes and its KV holds."""

    name: str
    layers: int
    heads: int  # query heads of this shard
    kv_heads: int  # KV heads of this shard
    head_dim: int
    hidden: int
    ffn: int  # MLP width of this shard
    vocab: int  # rows of this shard's embedding and output projection

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    def weight_bytes(self) -> int:
        per_layer = (self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
                     + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden)
        return 2 * (self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden)

    def activation_bytes(self, tokens: int) -> int:
        """An upper bound on the forward's working memory for ``tokens`` new tokens attending to as
        many: residual stream and norms, QKV and its rotated copies, repeated K and V, attention
        output, the prefix read from the pool, the MLP's two halves, fp32 norm temporaries; a third
        more for the allocator."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_token = 5 * self.hidden + (q + 2 * kv) + 2 * (q + kv) + 2 * q + q + 2 * kv + 2 * self.ffn
        return int(2 * tokens * per_token * 4 / 3)


GEOMETRIES = {g.name: g for g in (
    Geometry("llama-3.1-8b", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, ffn=14336, vocab=128256),
    # Llama-3.1-70B at tensor parallelism 8: 64 query and 8 KV heads, MLP 28672 and vocabulary split 8 ways
    Geometry("llama-3.1-70b-tp8", layers=80, heads=8, kv_heads=1, head_dim=128, hidden=8192, ffn=3584,
             vocab=16032),
    # for CPU tests: the same structure, tiny
    Geometry("tiny", layers=2, heads=4, kv_heads=2, head_dim=32, hidden=128, ffn=256, vocab=512),
)}


@dataclass
class Span:
    """One request's tokens ``[start, end)`` in a forward: where their K and V go in the pool, where the
    positions ``[0, end)`` they attend to are read from (when ``start`` > 0), and their rotary angles.
    Made once per forward, not once per layer."""

    start: int
    end: int
    write: tuple[torch.Tensor, torch.Tensor]  # (page, slot) of each new token
    read: torch.Tensor | None  # the pages of positions [0, end), where start > 0
    rope: tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Layer:
    qkv: torch.Tensor
    out: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor


class Decoder:
    """The decoder's weights (random, scaled to keep activations finite) and its forward over a paged pool."""

    def __init__(self, geo: Geometry, device: torch.device, seed: int = 0) -> None:
        self.geo, self.device = geo, device
        gen = torch.Generator(device=device).manual_seed(seed)
        q, kv = geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
        self.embed = self._rand(gen, geo.vocab, geo.hidden)
        self.layers = [_Layer(self._rand(gen, geo.hidden, q + 2 * kv), self._rand(gen, q, geo.hidden),
                              self._rand(gen, geo.hidden, geo.ffn), self._rand(gen, geo.hidden, geo.ffn),
                              self._rand(gen, geo.ffn, geo.hidden), self._ones(), self._ones())
                       for _ in range(geo.layers)]
        self.norm = self._ones()
        self.lm_head = self._rand(gen, geo.hidden, geo.vocab)
        self.inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, geo.head_dim, 2, device=device).float() / geo.head_dim)

    def _rand(self, gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=torch.bfloat16)
        return w.mul_(1.0 / math.sqrt(rows))

    def _ones(self) -> torch.Tensor:
        return torch.ones(self.geo.hidden, device=self.device, dtype=torch.bfloat16)

    def pool_view(self, pool: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
        """``pool`` ([num_blocks, layers, 2, block elements]) as [num_blocks, layers, 2, kv_heads, tpb, head_dim]."""
        g = self.geo
        return pool.view(pool.shape[0], g.layers, 2, g.kv_heads, tokens_per_block, g.head_dim)

    def embed_tokens(self, tokens: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(tokens, device=self.device)]

    def span(self, pages: list[int], start: int, end: int, tokens_per_block: int) -> Span:
        """The :class:`Span` of positions ``[start, end)`` of a request whose page table is ``pages``."""
        table = torch.tensor(pages, device=self.device)
        pos = torch.arange(end, device=self.device)
        page, slot = table[pos // tokens_per_block], pos % tokens_per_block
        angles = pos[start:].float()[:, None] * self.inv_freq[None]
        rope = angles.cos().to(torch.bfloat16)[:, None], angles.sin().to(torch.bfloat16)[:, None]
        read = table[:-(-end // tokens_per_block)] if start else None
        return Span(start, end, (page[start:], slot[start:]), read, rope)

    def layer(self, index: int, x: torch.Tensor, kv: torch.Tensor, span: Span) -> torch.Tensor:
        """Layer ``index`` for the tokens of ``span``: their K and V go into the pool, and they attend
        to the positions before them, read from it, and to each other, causally."""
        g, w = self.geo, self.layers[index]
        n, heads = x.shape[0], g.heads + g.kv_heads
        h = F.rms_norm(x, (g.hidden,), w.norm_attn, NORM_EPS)
        qkv = h @ w.qkv
        qk = _rotate(qkv[:, :heads * g.head_dim].view(n, heads, g.head_dim), *span.rope)  # q and k at once
        q, k = qk[:, :g.heads], qk[:, g.heads:]
        v = qkv[:, heads * g.head_dim:].view(n, g.kv_heads, g.head_dim)
        page, slot = span.write
        kv[page, index, 0, :, slot, :] = k
        kv[page, index, 1, :, slot, :] = v
        if span.read is None:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        else:  # every position attended to, read from the pool a page at a time as a paged kernel reads it
            pages = kv[:, index].index_select(0, span.read)  # [pages, 2, kv_heads, tpb, head_dim]
            both = pages.permute(1, 2, 0, 3, 4).reshape(2, g.kv_heads, -1, g.head_dim)[:, :, :span.end]
            k, v = both[0], both[1]
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                              attn_mask=causal_lower_right(n, span.end), enable_gqa=True)
        x = x + attn[0].transpose(0, 1).reshape(n, g.heads * g.head_dim) @ w.out
        h = F.rms_norm(x, (g.hidden,), w.norm_mlp, NORM_EPS)
        gate = F.silu(h @ w.gate, inplace=True)
        gate.mul_(h @ w.up)
        return x + gate @ w.down

    def warm_up(self, tokens: int, tokens_per_block: int) -> None:
        """Run every kernel of a forward once, outside any connector, as a server warms its model up
        before it serves: a prompt of ``tokens`` computed, then its last block again over the pages
        (the path of a suffix after a loaded prefix), on a pool of its own that is freed after."""
        g, blocks = self.geo, -(-tokens // tokens_per_block)
        pool = torch.zeros((blocks, g.layers, 2, g.kv_heads * tokens_per_block * g.head_dim),
                           dtype=torch.bfloat16, device=self.device)
        kv, pages = self.pool_view(pool, tokens_per_block), list(range(blocks))
        prompt = [i % g.vocab for i in range(tokens)]
        for start in (0, max(1, tokens - tokens_per_block)):
            span = self.span(pages, start, tokens, tokens_per_block)
            x = self.embed_tokens(prompt[start:])
            for index in range(g.layers):
                x = self.layer(index, x, kv, span)
            self.next_token(x[-1])

    def next_token(self, last: torch.Tensor) -> int:
        """The greedy token after the hidden state of the last position (synchronizes the device)."""
        h = F.rms_norm(last, (self.geo.hidden,), self.norm, NORM_EPS)
        return int((h @ self.lm_head).argmax().item())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the halves of each head rotated by their position's angles)."""
    a, b = x.chunk(2, -1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
