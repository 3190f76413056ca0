"""The KV cache and the rows' decoding state: every buffer a decoding step reads and writes, on the
model's backend (docs/decoding.md, "The KV cache and the rows' state")."""

from __future__ import annotations

import numpy as np

from nanoeuler_core.inference.decoder.rows import MAX_SEED, Sampling


class KVCache:
    """The device state of `batch` rows decoding with up to K tokens a step (S = ctx_len + K - 1
    positions: the K - 1 past the context take proposals that are never kept):

        kv              per block, (keys, values), each (B, S, KV, D)
        tokens          (B*W,) int64   per row its next token and W - 1 proposals, at the width W
        drafts          (B*(W-1), V)   the distributions the proposals were drawn from
        seeds           (B,) int64     the row's RNG key
        counters        (B,) int64     the index of tokens[b, 0] among the row's new tokens
        pos             (B,) int64     where tokens[b, 0] goes in the cache (S: a free row, never attended)
        temperature, top_k, top_p (B,) the row's sampling (backend floats, int64, float64)
        mask            (B, ceil(V / 32)) int32   the tokens the row may produce next (every bit: any)

    and on the host `pending` (B, K), each row's next token (kept already) and proposals, from
    which the token block is laid out again when the width changes."""

    def __init__(self, be, cfg, batch: int, K: int):
        self.be, self.cfg, self.batch, self.K = be, cfg, batch, K
        self.S = cfg.ctx_len + K - 1
        B, shape = batch, (batch, self.S, cfg.n_kv_heads, cfg.head_dim)
        self.kv = [(be.zeros(shape), be.zeros(shape)) for _ in range(cfg.n_layers)]
        self.tokens = be.zeros((B * K,), dtype=np.int64)
        self.drafts = be.zeros((B * (K - 1), cfg.vocab_size))
        self.seeds, self.counters, self.pos = (be.zeros((B,), dtype=np.int64) for _ in range(3))
        self.temperature, self.top_k, self.top_p = be.zeros((B,)), be.zeros((B,), dtype=np.int64), \
            be.zeros((B,), dtype=np.float64)
        be.copy_(self.top_p, np.ones(B))
        self.mask = be.zeros((B, (cfg.vocab_size + 31) // 32), dtype=np.int32)   # 32 tokens a word
        be.copy_(self.mask, np.full(self.mask.shape, -1, dtype=np.int32))
        self.width = K                                     # tokens per row in the token block
        self.pending = np.zeros((B, K), dtype=np.int64)
        self._row_states = {}                              # (row, width) -> `state` of that row

    @staticmethod
    def bytes_needed(be, cfg, batch: int, K: int) -> int:
        """The bytes a decoder of `batch` rows allocates: the cache, the step's logits (twice) and its activations."""
        itemsize = np.dtype(be.dtype).itemsize
        cache = 2 * cfg.n_layers * batch * (cfg.ctx_len + K - 1) * cfg.n_kv_heads * cfg.head_dim * itemsize
        logits = batch * K * K * cfg.vocab_size * itemsize
        activations = batch * K * (2 * cfg.hidden_dim + 4 * cfg.dim) * itemsize
        return cache + 2 * logits + activations

    def kv_rows(self, n: int) -> list[tuple]:
        """Each block's (keys, values) of rows 0..n-1."""
        return [(k[:n], v[:n]) for k, v in self.kv]

    def state(self, first: int, n: int, W: int) -> tuple:
        """The sample op's state of rows first..first+n-1 at width W: tokens (n, W), drafts (n, W - 1, V),
        seeds, counters, pos and the sampling settings (n,), the masks (n, ceil(V / 32))."""
        rows = slice(first, first + n)
        tokens = self.tokens[first * W:(first + n) * W].reshape(n, W)
        drafts = self.drafts[first * (W - 1):(first + n) * (W - 1)].reshape(n, W - 1, self.cfg.vocab_size)
        return (tokens, drafts) + tuple(a[rows] for a in (self.seeds, self.counters, self.pos, self.temperature,
                                                            self.top_k, self.top_p, self.mask))

    def row_state(self, b: int, W: int) -> tuple:
        """`state` of row b alone at width W, its views made once."""
        if (b, W) not in self._row_states:
            self._row_states[(b, W)] = self.state(b, 1, W)
        return self._row_states[(b, W)]

    def start_row(self, b: int, seed: int, sampling: Sampling) -> None:
        """Row b's seed and sampling settings."""
        temperature, top_k, top_p = sampling.settings()
        for buffer, value in ((self.seeds, seed % MAX_SEED), (self.temperature, temperature),
                              (self.top_k, top_k), (self.top_p, top_p)):
            self.be.copy_(buffer[b:b + 1], np.array([value]))

    def free_row(self, b: int) -> None:
        """Row b's later tokens fall outside the cache: no attention, nothing written."""
        self.be.copy_(self.pos[b:b + 1], np.array([self.S]))

    def lay_out(self, W: int) -> None:
        """Lay the rows' tokens out at width W from `pending` (proposals never drawn at that width
        are stale ones). The host must hold the tokens of every step launched."""
        self.be.copy_(self.tokens[:self.batch * W], np.ascontiguousarray(self.pending[:, :W]).reshape(-1))
        self.width = W
