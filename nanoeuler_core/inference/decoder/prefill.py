"""Prompts into rows' caches: the decoding step's own forward over a prompt's tokens, in chunks
interleaved with the decoding steps, on staging rows of their own, a cached prefix copied in
first; then the row's cache filled from its staging row and its first token drawn (docs/decoding.md,
"Prefill")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoeuler_core.inference.decoder.kv_cache import KVPlanes

PREFILL_MIN = 16          # the shortest chunk a backend that captures runs (shorter ones are padded)
PREFILL_TOKENS = 256      # tokens a chunk forward takes at most, over all the prompts it advances
STAGING_ROWS = 8          # prompts prefilled at once (one staging row each)


@dataclass(eq=False)
class Filling:
    """A prompt being prefilled for row `b` on staging row `r`: its tokens `ids`, the first `done`
    of which are in the staging row already; `generated` tokens of the row came before (its RNG
    counter goes on from there)."""

    b: int
    r: int
    ids: list[int]
    done: int
    generated: int
    last: object = None   # once done: its last token's output (1, C), in its staging row's buffer; its first token's source

    @property
    def left(self) -> int:
        return len(self.ids) - self.done


class Prefill:
    """Prefills rows of `cache` (KVCache) with `forward` (DecodeForward): a prompt's tokens go
    through the step's own ops (`hidden`), their keys and values into a staging row (its position
    runs on from the cached prefix), up to PREFILL_TOKENS tokens a forward over all the prompts
    under way (`advance`), so that decoding steps go on between two chunks. A finished prompt's
    keys and values are copied into its row, its blocks kept in the prefix cache, and its first
    token and proposals drawn. The decoding ops compute each token as they would alone, so a
    prompt's cache is the same bit for bit whatever the chunks, the prompts beside it, or the
    prefix reused, and the same as decoding its tokens one by one would leave.

    Staging rows 0..STAGING_ROWS-1 take the prompts a server admits; the last, its own, takes a
    prompt filled at once (`fill`: `Decoder.admit`, a window slide). Where the backend captures
    work, a forward runs over m staging rows (a power of two) and T tokens each (a power of two, at
    least PREFILL_MIN), captured once and replayed where the decoder captures; padding tokens go to
    positions past the prompt's, never copied out."""

    def __init__(self, model, forward, cache, prefix, capture: bool):
        self.forward, self.cache, self.prefix, self.be, self.capture = forward, cache, prefix, model.backend, capture
        self.cfg = cfg = model.cfg
        self.staging = KVPlanes(self.be, cfg, STAGING_ROWS + 1, cache.S)
        last = self.be.zeros((STAGING_ROWS + 1, cfg.dim))
        self._last = [last[r:r + 1] for r in range(STAGING_ROWS + 1)]   # per staging row, a Filling's `last`
        self.under_way: list[Filling] = []          # prompts on the staging rows of `advance`
        self._runs = {}        # (first staging row, rows, T) -> its ids and pos buffers, its (captured) forward
        self.logits = None     # the last finished row's first-token logits (1, W*V), on the backend

    @property
    def captures(self) -> bool:
        return self.capture and self.be.captures

    def free_staging(self) -> int:
        """Staging rows free for `start`."""
        return STAGING_ROWS - len(self.under_way)

    def start(self, b: int, ids: list[int], generated: int) -> Filling:
        """Begin prefilling `ids` for row b on a free staging row, from the longest prefix the prefix
        cache holds (copied in)."""
        r = min(set(range(STAGING_ROWS)) - {f.r for f in self.under_way})
        filling = Filling(b, r, list(ids), self._reuse(ids, r), generated)
        self.under_way.append(filling)
        return filling

    def drop(self, b: int) -> None:
        """Stop prefilling for row b (retired before its prompt was in)."""
        self.under_way = [f for f in self.under_way if f.b != b]

    def advance(self) -> list[Filling]:
        """One chunk forward over the prompts under way; the ones it finishes leave the staging rows,
        their keys and values still there for `finish`."""
        fillings = self.under_way
        if not fillings:
            return []
        self._chunk(fillings, 0, max(f.r for f in fillings) + 1)
        finished = [f for f in fillings if f.left == 0]
        self.under_way = [f for f in fillings if f.left > 0]
        return finished

    def fill(self, b: int, ids: list[int], generated: int) -> None:
        """Prefill row b with `ids` at once, on the staging row of its own, and draw its next token
        (`finish`)."""
        filling = Filling(b, STAGING_ROWS, list(ids), 0, generated)
        filling.done = self._reuse(ids, filling.r)
        while filling.left:
            self._chunk([filling], filling.r, 1)
        self.finish(filling)

    def finish(self, filling: Filling) -> None:
        """Row filling.b's cache from its staging row, its blocks into the prefix cache, and its next
        token and proposals drawn at the cache's width into the token block and `cache.pending`."""
        be, cache, b, r, T = self.be, self.cache, filling.b, filling.r, len(filling.ids)
        be.copy_(cache.planes.span(b, 0, T), self.staging.span(r, 0, T))
        self.prefix.store(filling.ids, self.staging, r)
        state = cache.row_state(b, cache.width)
        counters, pos = state[3:5]
        be.copy_(pos, np.array([T - 1], dtype=np.int64))
        be.copy_(counters, np.array([filling.generated - 1], dtype=np.int64))
        _, self.logits = self.forward.sample(filling.last, 1, 1, state)
        cache.pending[b, :cache.width] = np.array(be.to_host(state[0]))[0]

    def length(self, T: int, rows: int) -> int:
        """Tokens per staging row of a chunk forward over `rows` rows, T left at most in a row: all of
        them within PREFILL_TOKENS over the rows; where the backend captures work, a power of two of
        PREFILL_MIN or more, whether or not this decoder captures: eager runs run the captured runs'
        shapes, so that a prompt's tokens never depend on capturing."""
        most = max(1, PREFILL_TOKENS // rows)
        if not self.be.captures:
            return min(T, most)
        return min(max(PREFILL_MIN, 1 << (T - 1).bit_length()), max(PREFILL_MIN, most))

    def warm_up(self) -> None:
        """Capture every chunk forward `advance` and `fill` may run, where the backend captures."""
        if not self.captures:
            return
        T = PREFILL_MIN
        while T <= max(PREFILL_MIN, PREFILL_TOKENS):
            for lo, m in [(0, 1 << i) for i in range(STAGING_ROWS.bit_length())] + [(STAGING_ROWS, 1)]:
                if m <= STAGING_ROWS and T == self.length(T, m):
                    self._run(lo, m, T)
            T *= 2

    def _reuse(self, ids: list[int], r: int) -> int:
        """Copy the longest cached prefix of `ids` into staging row r; its length in tokens."""
        slots = self.prefix.lookup(ids)
        self.prefix.copy_into(slots, self.staging, r)
        return len(slots) * self.prefix.block

    def _chunk(self, fillings: list[Filling], lo: int, n: int) -> None:
        """One forward over staging rows lo..lo+n-1 (`fillings` among them, the others idle: at
        position S, where nothing is written), each filling's next tokens at its own position."""
        m = n if not self.be.captures else min(STAGING_ROWS + 1 - lo, 1 << (n - 1).bit_length())
        T = self.length(max(f.left for f in fillings), m)
        ids = np.zeros((m, T), dtype=np.int64)
        pos = np.full(m, self.cache.S, dtype=np.int64)
        for f in fillings:
            t = min(T, f.left)
            ids[f.r - lo, :t] = f.ids[f.done:f.done + t]
            pos[f.r - lo] = f.done
        ids_buffer, pos_buffer, run = self._run(lo, m, T)
        self.be.copy_(ids_buffer, ids.reshape(-1))
        self.be.copy_(pos_buffer, pos)
        out = run()
        for f in fillings:
            t = min(T, f.left)
            f.done += t
            if f.left == 0:   # its last token's output, before a later chunk overwrites `out`
                f.last = self._last[f.r]
                self.be.copy_(f.last, out[(f.r - lo) * T + t - 1:(f.r - lo) * T + t])

    def _run(self, lo: int, m: int, T: int):
        """The ids (m*T,) and pos (m,) buffers of a forward over staging rows lo..lo+m-1, T tokens
        each, and the forward (captured the first time where the backend captures)."""
        key = (lo, m, T)
        if key not in self._runs:
            be = self.be
            ids, pos = be.zeros((m * T,), dtype=np.int64), be.zeros((m,), dtype=np.int64)
            kv = [(k[lo:lo + m], v[lo:lo + m]) for k, v in self.staging.layers]

            def forward():
                with be.parallel(), be.computing():
                    return self.forward.hidden(ids, m, T, kv, pos)

            if self.captures:
                be.copy_(pos, np.full(m, self.cache.S, dtype=np.int64))   # the capture's own run writes nothing
                run, _ = be.capture(forward)
            else:
                run = forward
            self._runs[key] = ids, pos, run
        return self._runs[key]
