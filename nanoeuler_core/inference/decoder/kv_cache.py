"""The KV cache and the rows' decoding state: every buffer a decoding step reads and writes, on the
model's backend, and the prefix cache, blocks of keys and values kept for later prompts that begin
with the same tokens (docs/decoding.md, "The KV cache and the rows' state", "Prefix caching")."""

from __future__ import annotations

import collections

import numpy as np

from nanoeuler_core.inference.decoder.rows import MAX_SEED, Sampling


class KVPlanes:
    """The keys and values of every model block for `rows` rows of S positions, as one backend
    array `planes` (2 L, rows, S*KV*D): plane 2 l holds block l's keys, plane 2 l + 1 its values.
    A run of a row's positions is then one view over every block (`span`) and copies in one
    launch, where a copy per block and kind would cost the host 2 L of them.

        layers      per block, (keys, values), each (rows, S, KV, D): views of `planes`"""

    def __init__(self, be, cfg, rows: int, S: int):
        self.width = cfg.n_kv_heads * cfg.head_dim   # values a position holds in a plane
        self.planes = be.zeros((2 * cfg.n_layers, rows, S * self.width))
        shape = (rows, S, cfg.n_kv_heads, cfg.head_dim)
        self.layers = [(self.planes[2 * i].reshape(shape), self.planes[2 * i + 1].reshape(shape))
                       for i in range(cfg.n_layers)]

    def span(self, r: int, lo: int, hi: int):
        """Positions lo..hi-1 of row r in every plane: a (2 L, (hi - lo) * KV * D) view."""
        return self.planes[:, r, lo * self.width:hi * self.width]


class KVCache:
    """The device state of `batch` rows decoding with up to K tokens a step (S = ctx_len + K - 1
    positions: the K - 1 past the context take proposals that are never kept):

        planes          KVPlanes of the B rows; kv = planes.layers
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
        B = batch
        self.planes = KVPlanes(be, cfg, batch, self.S)
        self.kv = self.planes.layers
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
    def bytes_needed(be, cfg, batch: int, K: int, staging: int = 0, prefix_tokens: int = 0) -> int:
        """The bytes a decoder of `batch` rows allocates: the cache (with `staging` rows more, where
        prompts are prefilled, and a prefix cache of `prefix_tokens` tokens), the step's logits
        (twice) and its activations."""
        itemsize = np.dtype(be.dtype).itemsize
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize
        cache = per_token * ((batch + staging) * (cfg.ctx_len + K - 1) + prefix_tokens)
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
        _, _, seeds, _, _, temperatures, top_ks, top_ps, _ = self.row_state(b, self.width)
        for buffer, value in ((seeds, seed % MAX_SEED), (temperatures, temperature), (top_ks, top_k), (top_ps, top_p)):
            self.be.copy_(buffer, np.array([value]))

    def free_row(self, b: int) -> None:
        """Row b's later tokens fall outside the cache: no attention, nothing written."""
        self.be.copy_(self.row_state(b, self.width)[4], np.array([self.S]))

    def lay_out(self, W: int) -> None:
        """Lay the rows' tokens out at width W from `pending` (proposals never drawn at that width
        are stale ones). The host must hold the tokens of every step launched."""
        self.be.copy_(self.tokens[:self.batch * W], np.ascontiguousarray(self.pending[:, :W]).reshape(-1))
        self.width = W


class PrefixCache:
    """Keys and values of earlier prompts (and of rows' generated tokens), kept by blocks of `block`
    tokens for later prompts that begin with the same tokens, at most `capacity` tokens on the
    backend, the least recently used block evicted first:

        pool            KVPlanes of one row of capacity positions: slot s holds positions
                        s*block..(s+1)*block-1

    A block is known by its tokens chained with every token before it (the hash of its parent's
    key and its own tokens, as vLLM's), so a block is reused only after the same whole prefix.
    The decoding ops compute a token's keys and values the same whatever else is fed with it
    (docs/decoding.md, "Batch invariance"), so a copied block is bit for bit what prefilling its
    tokens again would give. Counts for a server's metrics: `stats()`."""

    def __init__(self, be, cfg, capacity: int, block: int):
        self.be, self.block = be, block
        self.slots = capacity // block
        self.pool = KVPlanes(be, cfg, 1, self.slots * block) if self.slots else None
        self._blocks: collections.OrderedDict[int, tuple[int, tuple]] = collections.OrderedDict()
        # key -> (slot, its tokens), least recently used first
        self._free = list(range(self.slots - 1, -1, -1))   # taken lowest first: a prompt's blocks in a run of slots
        self.lookups = self.hits = self.tokens_reused = self.blocks_stored = self.evictions = 0

    def keys(self, tokens: list[int], n_blocks: int) -> list[int]:
        """The chained keys of the first n_blocks blocks of `tokens`."""
        keys, parent, B = [], 0, self.block
        for j in range(n_blocks):
            parent = hash((parent, tuple(tokens[j * B:(j + 1) * B])))
            keys.append(parent)
        return keys

    def lookup(self, prompt: list[int]) -> list[int]:
        """The slots of the longest run of `prompt`'s first blocks held here, leaving at least its
        last token to prefill (its logits give the first new token); counted, and made the most
        recently used."""
        if not self.slots:
            return []
        self.lookups += 1
        B, found = self.block, []
        for j, key in enumerate(self.keys(prompt, (len(prompt) - 1) // B)):
            entry = self._blocks.get(key)
            if entry is None or entry[1] != tuple(prompt[j * B:(j + 1) * B]):
                break
            self._blocks.move_to_end(key)
            found.append(entry[0])
        if found:
            self.hits += 1
            self.tokens_reused += len(found) * B
        return found

    def copy_into(self, slots: list[int], planes: KVPlanes, r: int) -> None:
        """Row r of `planes` from position 0: the blocks held in `slots`, in order."""
        B = self.block
        for j, slot, n in _runs(list(enumerate(slots))):
            self.be.copy_(planes.span(r, j * B, (j + n) * B), self.pool.span(0, slot * B, (slot + n) * B))

    def store(self, tokens: list[int], planes: KVPlanes, r: int) -> None:
        """Keep the whole blocks of `tokens`, whose keys and values row r of `planes` holds from
        position 0, evicting the least recently used blocks where no slot is free."""
        B = self.block
        n_blocks = min(len(tokens) // B, self.slots)   # never evicts a block of this prefix to store another
        stored = []   # (block, slot) of the blocks new here
        for j, key in enumerate(self.keys(tokens, n_blocks)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            if self._free:
                slot = self._free.pop()
            else:
                _, (slot, _) = self._blocks.popitem(last=False)
                self.evictions += 1
            self._blocks[key] = slot, tuple(tokens[j * B:(j + 1) * B])
            self.blocks_stored += 1
            stored.append((j, slot))
        for j, slot, n in _runs(stored):
            self.be.copy_(self.pool.span(0, slot * B, (slot + n) * B), planes.span(r, j * B, (j + n) * B))

    def stats(self) -> dict:
        """prefix_cache_lookups (prompts looked up), prefix_cache_hits (those that reused a block or
        more), prefix_tokens_reused (prefill tokens skipped), prefix_cache_blocks (held now, of
        prefix_cache_slots), prefix_cache_evictions."""
        return {"prefix_cache_lookups": self.lookups, "prefix_cache_hits": self.hits,
                "prefix_tokens_reused": self.tokens_reused, "prefix_cache_blocks": len(self._blocks),
                "prefix_cache_slots": self.slots, "prefix_cache_evictions": self.evictions}


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(block, slot) pairs as runs (first block, first slot, length) of consecutive blocks in
    consecutive slots: one copy a run rather than one a block (each copy costs the host a launch)."""
    runs = []
    for j, slot in pairs:
        if runs and (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]) == (j, slot):
            runs[-1][2] += 1
        else:
            runs.append([j, slot, 1])
    return [tuple(run) for run in runs]
