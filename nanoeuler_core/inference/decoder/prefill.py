"""A row's prefill: the model's own forward over the prompt (the training ops: matrix products over
all its tokens), whose keys and values fill the row's cache, then the row's first token drawn
(docs/decoding.md, "Prefill")."""

from __future__ import annotations

import numpy as np


PREFILL_MIN = 16          # the shortest prefill a backend that captures runs (shorter prompts are padded)


class Prefill:
    """Prefills rows of `cache` (KVCache) with the model's forward, drawing each row's first tokens
    with `forward` (DecodeForward). Where the backend captures work, a prompt is padded to a power
    of two and the forward of each such length is captured once and replayed (a prefill is then
    one launch); the padding changes none of the prompt's tokens (attention is causal), and its
    cache entries are overwritten by decoding before any query reads them."""

    def __init__(self, model, forward, cache, capture: bool):
        self.model, self.forward, self.cache, self.be, self.capture = model, forward, cache, model.backend, capture
        self._runs = {}           # prefill length -> its ids buffer, its (captured) forward
        self._cache_views = {}    # (row, prefill length) -> the forward's output, `_cache_pairs`
        self.logits = None        # the last row's first-token logits (1, W*V), on the backend

    @property
    def captures(self) -> bool:
        return self.capture and self.be.captures

    def length(self, T: int) -> int:
        """The tokens a prefill of T runs over: where the backend captures work, T padded to a power of
        two (at least PREFILL_MIN, at most the context), one captured forward per such length; else T.
        Padded whether or not this decoder captures: a matrix product's kernel, hence its rounding,
        may change with the number of rows, and eager runs must give the captured runs' tokens."""
        if not self.be.captures:
            return T
        return min(self.model.cfg.ctx_len, max(PREFILL_MIN, 1 << (T - 1).bit_length()))

    def lengths(self) -> list[int]:
        """Every length a prompt may be padded to where the backend captures (none where it does not)."""
        ctx = self.model.cfg.ctx_len
        return sorted({self.length(min(ctx, 1 << i)) for i in range(ctx.bit_length() + 1)}) if self.captures else []

    def run(self, ids: np.ndarray):
        """The model's forward over the P token ids (host, P,): each block's keys and values
        (1, P, KV, D) and the last block's output (P, C). The ids go to a device buffer of length P;
        the forward over it is captured the first time where the backend captures, then replayed."""
        P = len(ids)
        if P not in self._runs:
            buffer = self.be.zeros((P,), dtype=np.int64)
            weights = self.forward.w

            def forward():
                blocks = []
                with self.be.parallel(), self.be.computing():
                    self.model.run_blocks(buffer, P, weights.forward,
                                          lambda i, block: blocks.append((block.k, block.v, block.out_saved[0])))
                return [(k, v) for k, v, _ in blocks], blocks[-1][2]

            self.be.copy_(buffer, ids)
            run, result = self.be.capture(forward) if self.capture else (forward, forward())
            self._runs[P] = buffer, run
            return result
        buffer, run = self._runs[P]
        self.be.copy_(buffer, ids)
        return run()

    def fill(self, b: int, ids: list[int], generated: int) -> None:
        """Fill row b's cache with `ids` from position 0 (its matrix products in the decoding weights'
        precision) and draw its next token and proposals at the cache's width, into the token block
        and `cache.pending`; `generated` tokens of the row came before (its RNG counter goes on from there)."""
        be, cache, T = self.be, self.cache, len(ids)
        padded = np.zeros(self.length(T), dtype=np.int64)
        padded[:T] = ids
        keys_values, out = self.run(padded)
        for dst, src in self._cache_pairs(b, keys_values, out):
            be.copy_(dst, src)
        last = be.zeros((1, self.model.cfg.dim))   # the last block's output at the last token, in float32
        be.copy_(last, out[T - 1:T])
        state = cache.row_state(b, cache.width)
        counters, pos = state[3:5]
        be.copy_(pos, np.array([T - 1], dtype=np.int64))
        be.copy_(counters, np.array([generated - 1], dtype=np.int64))
        _, self.logits = self.forward.sample(last, 1, 1, state)
        cache.pending[b, :cache.width] = np.array(be.to_host(state[0]))[0]

    def _cache_pairs(self, b: int, keys_values, out) -> list[tuple]:
        """(row b's cache, the prefill's keys or values) pairs, flat, of every block: the P prefilled
        tokens from position 0. Made once per row and captured prefill (the same buffers each
        time): slicing device arrays costs host time, some 100 slices a prompt."""
        P, (_, KV, D) = len(out), keys_values[0][0].shape[1:]
        cached_out, pairs = self._cache_views.get((b, P), (None, None))
        if cached_out is not out:
            pairs = [(cache[b, :P].reshape(P * KV * D), new[0].reshape(P * KV * D))
                     for caches, news in zip(self.cache.kv, keys_values) for cache, new in zip(caches, news)]
            if self.captures:   # else each prefill's buffers are new
                self._cache_views[(b, P)] = out, pairs
        return pairs
