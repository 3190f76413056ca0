"""Decoder: one model's batched decoding, plain or self-speculative, of a batch of prompts to the
end or of rows admitted, stepped and retired one by one (docs/decoding.md)."""

from __future__ import annotations

import math
import time
import weakref

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.inference.constraint import fill_masks
from nanoeuler_core.inference.decoder.forward import DECODE_OPS, DecodeForward
from nanoeuler_core.inference.decoder.kv_cache import KVCache, PrefixCache
from nanoeuler_core.inference.decoder.pipeline import StepInFlight, StepLauncher
from nanoeuler_core.inference.decoder.prefill import STAGING_ROWS, Filling, Prefill
from nanoeuler_core.inference.decoder.rows import DecodeStats, Row, Sampling
from nanoeuler_core.inference.decoder.speculation import SpeculationPolicy
from nanoeuler_core.inference.decoder.weights import DecodeWeights, check_weights

DECODERS_PER_MODEL = 4    # decoders (KV caches, captured graphs) kept per model for later calls
PREFIX_BLOCK = 16         # tokens of a prefix cache block


class Decoder:
    """Batched decoding of `batch_size` rows of one model on its backend: plain (speculative=False),
    speculative with every head (True), or the policy's widths (None; SpeculationPolicy); a batch
    of prompts at once (`generate`), or rows that start and end on their own (`admit`, `step`,
    `retire`), each free or held to a grammar (a Constraint: structured outputs). `sampling` is the
    rows' sampling where `generate` is not told another; `weights` "bf16" or "fp32" (default: bf16
    where the backend and the decoding ops run it); `run_ahead` whether `step` launches the next
    step before it takes the results of one (default: where the steps are captured);
    `prefix_cache_tokens` the tokens of keys and values kept for later prompts that begin the same
    way (default: as many as the rows' cache holds, batch_size * ctx_len; 0: none).

    Its parts: `cache` (KVCache), `prefix_cache` (PrefixCache), `forward` (DecodeForward, reading
    DecodeWeights), `prefill` (Prefill), `launcher` (StepLauncher) and `policy` (SpeculationPolicy)."""

    def __init__(self, model, batch_size: int, speculative: bool | None = None, sampling: Sampling = Sampling(),
                 capture: bool = True, weights: str | None = None, run_ahead: bool | None = None,
                 prefix_cache_tokens: int | None = None):
        cfg = model.cfg
        if speculative and cfg.n_mtp < 2:
            raise ValueError("speculative decoding needs the multi-token-prediction heads, and this model has "
                             "n_mtp = 1: pass --no-speculative (speculative=False)")
        self.model, self.cfg, self.be = model, cfg, model.backend
        self.batch, self.sampling, self.capture = batch_size, sampling, capture
        self.run_ahead = (capture and self.be.captures) if run_ahead is None else run_ahead
        self.K = 1 if speculative is False else cfg.n_mtp
        self.policy = SpeculationPolicy(self.K, adaptive=speculative is None and self.K > 1,
                                        multi_token_step_cheap=self.be.multi_token_step_cheap)
        ops = registry.kernels_on(model.backend_name, DECODE_OPS)
        self.weights = check_weights(model.backend_name, weights, model)
        if prefix_cache_tokens is None:
            prefix_cache_tokens = batch_size * cfg.ctx_len
        if prefix_cache_tokens < 0:
            raise ValueError(f"the prefix cache holds 0 tokens or more, got {prefix_cache_tokens}")
        prefix_cache_tokens -= prefix_cache_tokens % PREFIX_BLOCK
        self.bytes_needed = KVCache.bytes_needed(self.be, cfg, batch_size, self.K, STAGING_ROWS + 1,
                                                 prefix_cache_tokens)
        limit = self.be.memory_limit()
        if limit is not None and self.bytes_needed > limit:
            raise ValueError(self._too_large(f"{limit / 2**30:.1f} GiB of memory this machine can give it"))
        try:
            self.cache = KVCache(self.be, cfg, batch_size, self.K)
            self.prefix_cache = PrefixCache(self.be, cfg, prefix_cache_tokens, PREFIX_BLOCK)
            self.forward = DecodeForward(model, ops, DecodeWeights(model, self.weights, self.K))
            self.launcher = StepLauncher(self.be, self.forward, self.cache, capture)
            self.prefill = Prefill(model, self.forward, self.cache, self.prefix_cache, capture)   # its staging rows
        except Exception as exc:  # MemoryError on the CPU, the driver's CUDA_ERROR_OUT_OF_MEMORY on a GPU
            if isinstance(exc, MemoryError) or "OUT_OF_MEMORY" in str(exc):
                raise ValueError(self._too_large("memory free on the device")) from None
            raise
        self.rows: list[Row | None] = [None] * batch_size   # the row decoding in each slot, None where free
        self.admitting: dict[int, tuple[Row, Sampling, int, Filling]] = {}   # row -> its prompt under way (`start`)
        self._in_flight: StepInFlight | None = None          # the step launched, its results not yet taken
        self.masks = np.full(self.cache.mask.shape, -1, dtype=np.int32)   # the rows' token masks, host side
        # counted over the decoder's life (DecodeStats)
        self.steps = self.speculative_steps = self.row_steps = self.proposed = self.accepted = 0

    def _too_large(self, what: str) -> str:
        return (f"a batch of {self.batch} rows needs {self.bytes_needed / 2**30:.1f} GiB for its KV cache and "
                f"buffers, more than the {what}: generate fewer rows at once (--num-samples, or fewer prompts)")

    # ----------------------------------------------------------------------------------------
    # rows: admitted, stepped, retired

    def admit(self, b: int, prompt: list[int], seed: int, sampling: Sampling, max_new_tokens: int,
              eos_id: int | None = None, on_token=None, constraint=None, top_logprobs: int | None = None) -> Row:
        """Start the free row b on `prompt` (token ids, 1 <= length <= ctx_len) with its own seed and
        sampling, up to max_new_tokens new tokens or the first eos_id (not included): its cache is
        prefilled and its first token kept. on_token(b, token) sees each token as it is kept, here
        and in later steps. `constraint` (inference/constraint.py), if given, holds every token to
        its grammar, and the row ends where the grammar does. With `top_logprobs` (a count), the row
        keeps each new token's TokenLogprob (`Row.logprobs`, before on_token sees it): only such a
        row's logits come to the host. Returns the row's progress (Row)."""
        self._check_admission(b, prompt)
        row = Row(b, list(prompt), max_new_tokens, eos_id, on_token, sampling.temperature == 0,
                  constraint, top_logprobs)
        if row.active:
            self._activate(row, seed, sampling)
        self.rows[b] = row   # before on_token sees its first token
        if row.active:
            self._fill(row, row.sequence)
        return row

    def start(self, b: int, prompt: list[int], seed: int, sampling: Sampling, max_new_tokens: int,
              eos_id: int | None = None, on_token=None, constraint=None, top_logprobs: int | None = None) -> None:
        """`admit` without waiting for the prefill: row b is taken, its prompt (after the longest
        prefix the prefix cache holds) goes on a staging row and is prefilled a chunk at a time by
        `prefill_chunk`, between decoding steps, which then keeps its first token. Needs a free
        staging row (`can_start`)."""
        self._check_admission(b, prompt)
        if not self.can_start():
            raise ValueError("every staging row is prefilling a prompt: call prefill_chunk first")
        row = Row(b, list(prompt), max_new_tokens, eos_id, on_token, sampling.temperature == 0,
                  constraint, top_logprobs)
        if not row.active:
            self.rows[b] = row
            return
        self.admitting[b] = row, sampling, seed, self.prefill.start(b, row.sequence, 0)

    def can_start(self) -> bool:
        """Whether `start` has a staging row for one more prompt."""
        return self.prefill.free_staging() > 0

    def prefill_chunk(self) -> list[Row]:
        """One chunk forward over the prompts `start`ed (at most PREFILL_TOKENS tokens over them all);
        the rows whose prompts it finishes become active, their first tokens kept, and are returned."""
        ready = []
        for filling in self.prefill.advance():
            row, sampling, seed, _ = self.admitting.pop(filling.b)
            self._activate(row, seed, sampling)
            self._constrain([row])
            self.prefill.finish(filling)
            row.position = len(row.sequence)
            self.rows[row.b] = row   # before on_token sees its first token
            row.keep(self.cache.pending[row.b, :1], self._head_logits(row, self.prefill.logits, 0, 1))
            ready.append(row)
        return ready

    def _check_admission(self, b: int, prompt: list[int]) -> None:
        if self.rows[b] is not None or b in self.admitting:
            raise ValueError(f"row {b} is in use: retire it first")
        if not 1 <= len(prompt) <= self.cfg.ctx_len:
            raise ValueError(f"a prompt must have 1 to {self.cfg.ctx_len} tokens, got {len(prompt)}")

    def _activate(self, row: Row, seed: int, sampling: Sampling) -> None:
        """Row b's seed and sampling on the device, once no step in flight is left without it."""
        self._settle()   # the next step computes this row too: no step in flight may be left without it
        self.cache.start_row(row.b, seed, sampling)
        if not row.greedy:   # its proposals must be drawn at the width its steps will have
            self._set_width(self.policy.fixed_width())

    def step(self) -> None:
        """One decoding step of the active rows: a row whose cache is full first slides its window
        by half a context, then each keeps its next token (speculative: and the proposals accepted
        before it). Running ahead, the step may be the one the call before launched, and the one
        after it is launched before its results are taken. Does nothing when no row is active and
        no step is in flight."""
        if self._in_flight is None:
            ctx = self.cfg.ctx_len
            for row in self.active_rows():
                if row.position == ctx:  # the cache is full: slide the window by half a context
                    self._fill(row, row.sequence[-max(1, ctx // 2):])
            active = self.active_rows()
            if not active:
                return
            self._constrain(active)
            n = self._rows_computed(active)
            W = self.choose_width(n)
            fresh = min(W, self.cache.width) - 1   # proposals the rows drew at this width or wider (the rest are stale)
            self._set_width(W)
            self._in_flight = StepInFlight(n, W, fresh, active, *self.launcher.launch(n, W))
        launched, ahead = self._in_flight, None
        if self._may_run_ahead(launched):   # the same step again, every proposal it judges drawn at its width
            ahead = StepInFlight(launched.n, launched.width, launched.width - 1, self.active_rows(),
                                 *self.launcher.launch(launched.n, launched.width))
        self._in_flight = ahead   # before collecting: should on_token raise, `_settle` still finds the step ahead
        self._collect(launched)

    def retire(self, b: int) -> Row:
        """Free row b, done or not (its tokens so far stay in the returned Row). A step in flight may
        still compute the row: it need not be waited for, since collecting it skips the row (no longer
        active), and the position written here reaches the device after that step (the backend runs
        work in the order it is queued)."""
        if b in self.admitting:   # retired before its prompt was in: nothing of it reached the row
            self.prefill.drop(b)
            return self.admitting.pop(b)[0]
        row, self.rows[b] = self.rows[b], None
        if row is None:
            raise ValueError(f"row {b} is free already")
        row.active = False
        self._remember(row)
        self.cache.free_row(b)
        if row.constraint is not None:   # a free row allows every token
            self.masks[b] = -1
            self.be.copy_(self.cache.mask[b:b + 1], self.masks[b:b + 1])
        return row

    def _remember(self, row: Row) -> None:
        """Keep the blocks of the row's tokens in the prefix cache (a later prompt may go on from
        its answer): the cache holds tokens 0..position-1 of its sequence unless its window slid."""
        if row.position == len(row.sequence) - 1 and row.position >= self.prefix_cache.block:
            self.prefix_cache.store(row.sequence[:row.position], self.cache.planes, row.b)

    def active_rows(self) -> list[Row]:
        """The rows still decoding, in row order."""
        return [row for row in self.rows if row is not None and row.active]

    def free_rows(self) -> list[int]:
        """The rows that `admit` may start, lowest first."""
        return [b for b, row in enumerate(self.rows) if row is None and b not in self.admitting]

    def choose_width(self, n: int) -> int:
        """The width of the next step over rows 0..n-1, the policy's for the active rows; 1 while a
        row is held to a grammar (its mask allows the next token only: proposals after it are unchecked)."""
        if self._constrained():
            return 1
        return self.policy.width(n, all(row.greedy for row in self.active_rows()))

    def _constrained(self) -> bool:
        """Whether an active row is held to a grammar."""
        return any(row.constraint is not None for row in self.active_rows())

    def _constrain(self, rows: list[Row]) -> None:
        """The masks of the rows among `rows` held to a grammar (the tokens it allows next) to the
        device, with those of the rows below them (every bit set where free)."""
        held = [(row.constraint, row.b) for row in rows if row.constraint is not None]
        if held:
            fill_masks(held, self.masks)
            n = 1 + max(b for _, b in held)
            self.be.copy_(self.cache.mask[:n], self.masks[:n])

    def _fill(self, row: Row, ids: list[int]) -> None:
        """Prefill the row's cache with `ids` (its prompt, or the last half context of its tokens)
        and keep its next token."""
        self._constrain([row])
        self.prefill.fill(row.b, ids, len(row.new))
        row.position = len(ids)
        row.keep(self.cache.pending[row.b, :1], self._head_logits(row, self.prefill.logits, 0, 1))

    def _rows_computed(self, active: list[Row]) -> int:
        """n of a step over the active rows: rows 0..n-1, a power of two covering them."""
        return min(self.batch, 1 << active[-1].b.bit_length())

    def _may_run_ahead(self, launched: StepInFlight) -> bool:
        """Whether the step after `launched`, which is in flight, may be launched before its results
        are taken: the decoder runs ahead, the next step would compute the same rows at the same
        width anyway, no row needs its window slid before it, some row can still take tokens, and no
        row is held to a grammar (its next mask needs the token in flight)."""
        active = self.active_rows()
        if not self.run_ahead or not active or self._constrained():
            return False
        n, W = launched.n, launched.width
        if self._rows_computed(active) != n or self.choose_width(n) != W:
            return False
        # The host's positions and token counts lag the device's by the step in flight, which moves a
        # row at most W positions and gives it at most W tokens: with position + W < ctx_len, the
        # step run ahead starts below ctx_len, where no slide is due.
        return all(row.position + W < self.cfg.ctx_len for row in active) and \
            any(row.max_new_tokens - len(row.new) > W for row in active)

    def _collect(self, launched: StepInFlight) -> None:
        """Take a launched step's results: each row it was launched for keeps its tokens, unless the
        row ended in the step before or was retired since (the token computed for it is dropped);
        the counts of the decoder's life and the policy's acceptance go on."""
        kept, tokens = launched.results()
        W, rows = launched.width, [row for row in launched.rows if row.active]
        counts = [int(kept[row.b]) for row in rows]
        self.steps += 1
        self.speculative_steps += W > 1
        self.row_steps += len(rows)
        self.proposed += (W - 1) * len(rows)
        self.accepted += sum(counts) - len(rows)
        self.policy.record(counts, launched.fresh)
        pending = self.cache.pending
        for row, m in zip(rows, counts):
            row.position += m
            # its kept proposals, then its next token: token j drawn from head 0 at fed token j
            row.keep(np.concatenate((pending[row.b, 1:m], tokens[row.b, :1])),
                     self._head_logits(row, launched.logits, row.b * W, m))
            pending[row.b, :W] = tokens[row.b]

    def _head_logits(self, row: Row, logits, first: int, m: int) -> np.ndarray | None:
        """Head 0's logits (m, V) at rows first..first+m-1 of a step's `logits` (.., W*V), on the
        host: only for a row that wants log-probabilities (None for the others)."""
        if row.top_logprobs is None:
            return None
        return np.asarray(self.be.to_host(logits[first:first + m]))[:, :self.cfg.vocab_size]

    def _settle(self) -> None:
        """Collect the step in flight, if any: the host then holds what the device holds, before it
        changes what a step reads."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._collect(launched)

    def _set_width(self, W: int) -> None:
        """Lay the rows' tokens out at width W on the device, once the step in flight is collected."""
        if W != self.cache.width:
            self._settle()
            self.cache.lay_out(W)

    def _row_counts(self) -> list[int]:
        """The row counts a step may compute: 1, 2, 4, ..., batch."""
        counts = [1]
        while counts[-1] < self.batch:
            counts.append(min(self.batch, 2 * counts[-1]))
        return counts

    # ----------------------------------------------------------------------------------------
    # compiling, capturing and timing the steps

    def warm_up(self) -> None:
        """Compile and capture the step over every row count `step` may use (1, 2, 4, ..., batch), at
        every width the policy may choose (timing them), and the prefill of every length a prompt
        may be padded to, so that no later step or prompt pays for it (a server does this before its
        first request)."""
        self._settle()
        for n in self._row_counts():   # two steps: one into each mailbox
            row = self.admit(n - 1, [0], 0, Sampling(0.0), 3)
            while row.active:
                self.step()
            self.retire(n - 1)
        self.prefill.warm_up()
        if self.policy.adaptive:
            self.measure()

    def measure(self, repeats: int = 3, rounds: int = 5) -> None:
        """Time a step of every width over every row count `step` may use (capturing it first), with the
        rows at half the context, into the policy's `step_seconds`: the fastest of `rounds` rounds
        that each time every width in turn, `repeats` steps each, so that a stall or a clock still
        rising falls on no width in particular. Every row must be free (it decodes dummy rows)."""
        self._settle()
        if self.free_rows() != list(range(self.batch)):
            raise ValueError("a decoder measures its steps with every row free: retire the rows first")
        be, B, pos = self.be, self.batch, self.cache.pos
        be.copy_(self.cache.temperature, np.zeros(B))
        for n in self._row_counts():
            for W in range(1, self.K + 1):   # captured (or compiled) before any is timed
                self._set_width(W)
                be.copy_(pos, np.full(B, self.cfg.ctx_len // 2))
                self.launcher.run(n, W)
            fastest = {}
            for _ in range(rounds):
                for W in range(1, self.K + 1):
                    self._set_width(W)
                    be.copy_(pos, np.full(B, self.cfg.ctx_len // 2))
                    be.synchronize()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        self.launcher.run(n, W)
                    fastest[W] = min(fastest.get(W, math.inf), (time.perf_counter() - start) / repeats)
            self.policy.step_seconds |= {(n, W): seconds for W, seconds in fastest.items()}
        be.copy_(pos, np.full(B, self.cache.S))   # free rows again: outside the cache

    # ----------------------------------------------------------------------------------------
    # a batch of prompts to the end

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int], eos_id: int | None = None,
                 on_token=None, stats: DecodeStats | None = None, sampling: Sampling | None = None,
                 constraints: list | None = None) -> list[list[int]]:
        """New tokens for each prompt (token ids, 1 <= length <= ctx_len), up to max_new_tokens per
        row or the first eos_id (not included), row i with seeds[i], `sampling` (default: the
        decoder's) and constraints[i] (default: none; see `admit`). on_token(row, token) sees each
        token as it is kept. A greedy call of the policy first measures the steps (`measure`) if
        they were not yet."""
        if len(prompts) != self.batch or len(seeds) != self.batch:
            raise ValueError(f"this decoder takes {self.batch} prompts and seeds, got {len(prompts)} and {len(seeds)}")
        if self.free_rows() != list(range(self.batch)):
            raise ValueError("this decoder's rows are in use (admitted, not retired)")
        self._settle()   # a step left in flight by rows driven one by one counts for them, not here
        start = time.perf_counter()
        counted = ("steps", "speculative_steps", "row_steps", "proposed", "accepted")
        before = [getattr(self, name) for name in counted]
        sampling = sampling or self.sampling
        rows = []
        with self.be.serial():
            self.forward.w.refresh()   # the model may have learnt since
            if self.policy.adaptive and sampling.temperature == 0 and (self.batch, 1) not in self.policy.step_seconds:
                self.measure()
            try:
                for b, (prompt, seed) in enumerate(zip(prompts, seeds)):
                    rows.append(self.admit(b, prompt, seed, sampling, max_new_tokens, eos_id, on_token,
                                           constraints[b] if constraints else None))
                while any(row.active for row in rows):
                    self.step()
            finally:   # whatever happened (an error, Ctrl-C), the rows are free for the next call
                for row in rows:
                    self.retire(row.b)
                self._settle()   # nothing left in flight, and its step counted in this call's stats
        if stats is not None:
            for name, then in zip(counted, before):
                setattr(stats, name, getattr(stats, name) + getattr(self, name) - then)
            stats.tokens += sum(len(row.new) for row in rows)
            stats.seconds += time.perf_counter() - start
            stats.rows = max(stats.rows, self.batch)
            stats.weights = self.weights
        return [row.new for row in rows]


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_for(model, batch_size: int, speculative: bool | None, sampling: Sampling,
                weights: str | None = None) -> Decoder:
    """The model's decoder for this batch size, mode (None: the policy) and weights, sampling as
    `sampling` (its rows' settings are buffers, so one decoder serves any), made on first use and
    kept (with its KV cache, captured steps, step timings and acceptance) for later calls; the least
    recently used go first."""
    decoders = _DECODERS.setdefault(model, {})
    key = (batch_size, speculative, weights)
    decoder = decoders.pop(key, None)
    if decoder is None:
        while len(decoders) >= DECODERS_PER_MODEL:
            decoders.pop(next(iter(decoders)))
        decoder = Decoder(model, batch_size, speculative, sampling, weights=weights)
    decoder.sampling = sampling
    decoders[key] = decoder
    return decoder
