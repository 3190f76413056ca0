"""Decoding: the model's forward for generation, a batched KV cache, and the step loop, plain or
self-speculative with the multi-token-prediction heads.

One `Decoder` serves one model and one batch size. It holds, on the model's backend, a KV cache
(B, S, KV, D) per block and the decoding state: the tokens to feed next (B, K), each row's
position, RNG counter, seed and sampling settings (B,), and the proposals' distributions
(B, K - 1, V). A step is backend work only, built from registered ops:

    embedding -> per block: norm_linear (q, k, v) -> decode_attention (RoPE, cache, attention)
                 -> linear_residual (wo) -> norm_swiglu (gate, up) -> linear_residual (w_down)
    -> norm_linear (final norm, heads) -> sample (verify, draw, advance the state)
    -> the accepted counts and next tokens copied into a mailbox the host reads without a copy

so the backend captures it once (a CUDA graph on the GPU) and replays it; only the accepted
counts and the next tokens come back to the host each step (see Running ahead). The prompt is
prefilled in one pass per row by the model's own forward (the training ops: matrix products over
the whole prompt, attention over its tokens), whose keys and values are copied into the row's
cache. Where the backend captures work, the prompt is padded to a power of two and the forward of
each such length is captured once and replayed (a prefill is then one launch, not hundreds).

Plain decoding feeds one token per row and step, and uses head 0. Speculative decoding with k
proposals (k < K = n_mtp heads) feeds the k + 1 tokens [next, proposal 1, ..., proposal k], where
proposal j came from head j at the row's last position, and computes heads 0..k; `sample` keeps
the proposals head 0 agrees with (exactly speculative sampling when sampling) and draws the next
token and k proposals from the last kept position. Entries cached for refused proposals are
overwritten by later steps before any query can read them (a query at position p reads keys 0..p
only). A step of width W = k + 1 reads the rows' tokens as one contiguous (B, W) block (the
embedding's ids); when the width changes, the host lays the tokens it holds out again at the new
width before the step (two small copies), and proposals a narrower step never drew are stale ones.

The policy (speculative=None, the default where the model has K > 1 heads). Each step, over the n
rows it computes, it runs the width W in 1..K with the most expected tokens per second,
(1 + expected proposals kept) / t(n, W), where that beats plain decoding's (W = 1) by
SPECULATION_MARGIN: t(n, W) is the measured time of a step of width W over n rows (`measure`, the
fastest of a few interleaved rounds, run by `warm_up` and by a greedy `generate` call; or told, in
`step_seconds`), taken as at least that of every narrower width (a wider step does a narrower one's
work and more: a time measured below it is noise, and would make speculation look free), and
proposal j's acceptance is the running rate at which it was kept when the j - 1 before it were
(counted over the decoder's life, from an optimistic start of 1 in 1, so that a new decoder tries
speculation before it has seen any). Greedy rows give the same tokens whatever the widths (a
proposal is kept only where it is head 0's argmax, stale or not). A sampled row's tokens do depend
on the widths (a kept proposal was drawn from the draft stream, a plain token from the sample
stream): while a sampled row is active, every step runs the width the backend's traits give, K
where a multi-token step is cheap (`multi_token_step_cheap`), else 1, whatever the batch, the
timings or the acceptance, so a sampled row's tokens depend only on its seed, as with a forced
mode. Until the steps over n rows are measured, steps over n rows run that width too. While the
decoder runs ahead, the policy chooses the width of a step before the results of the step before
it are in: its choice lags by a step (greedy tokens do not depend on it, sampled rows run the
fixed width).

Batch invariance. Every decoding op computes a row with the same operations in the same order
whatever the batch, the number of tokens fed with it, or its place among them, and a prompt is
prefilled for its row alone. So a token's logits are bit for bit the same decoded alone, in a
batch, or among speculative proposals: greedy speculative output equals plain greedy output
exactly, and a row of a batch equals the same prompt decoded alone (sampling too: each row has
its own RNG stream). (The prefill's products round as the training forward's do, not as a
token-by-token pass would: the cache it leaves is the full forward's.)

Rows. `generate` decodes a batch of prompts to the end. A server drives the rows one at a time
instead (continuous batching): `admit` starts a free row on a prompt with its own seed and sampling
(prefilling that row alone), `step` advances every active row, `retire` frees a row whether or not
it is done; rows join and leave between steps. A step computes rows 0..n-1 only, n the highest
active row plus one, rounded up to a power of two (one captured step per such n): a server that
fills the lowest free rows first pays for the rows it uses.

Running ahead. A step needs nothing from the host: `sample` leaves each row's next tokens in the
token block and advances its position and RNG counter on the device, so replaying the same step
again computes the following one. Where the backend captures (`run_ahead`), `step` launches the
following step before it takes the results of the one before, which the step left in host-visible
memory (`host_visible`; the host waits for it through `read_back`) without stopping the device:
the GPU computes step i + 1 while the host keeps step i's tokens, and at most one step is in flight
between two `step` calls, so two mailboxes suffice (steps alternate: one captured step per mailbox,
the step run ahead writing the other one). It runs ahead
only where the next step would have the same rows and width anyway (rows 0..n-1 covering the
active ones, the policy's width), no row can need its window slid before it (below), and some row
has tokens left to take after the step in flight; a row that ends in the step before gets a token
computed in the step run ahead, thrown away. Whatever changes from the host what a step reads
(`admit`, a change of width, `measure`) first collects the step in flight (its rows keep its
tokens then), and a `generate` call leaves none; `retire` need not (collecting a step skips a row
no longer active). So the tokens are those of the same steps run one after the other.

Context. A prompt may fill the whole context (ctx_len tokens); a longer one is an error. When a
row's next token would sit at position ctx_len, its cache is refilled with the last ctx_len // 2
tokens of the row and decoding goes on (plain and speculative refill at the same token, so they
still agree). The cache has K - 1 positions of slack past ctx_len where a speculative step may
write proposals that are never kept.

Weights. Where the backend runs bf16 and the decoding ops read bf16 weights there, the blocks'
matrices and norm scales and the heads are read from a bf16 copy (the model's own compute copy
when it runs in bf16, else one the decoder makes and refreshes at each `generate` call), with
float32 accumulation and a float32 residual stream; the embedding table and the final norm stay
float32. That halves the bytes a step reads. Tokens are then those of slightly different logits:
greedy bf16 decoding follows float32 decoding until two tokens are within bf16's rounding of
each other (near-ties), then the two may part (tests/test_generate.py states how far they agree).
`weights="fp32"` reads the float32 master weights.

Shapes: B rows, K heads used (1 plain, n_mtp otherwise), W = tokens fed per row in a step (1..K),
S = ctx_len + K - 1 cache positions, C = dim, H query heads, KV key/value heads of D dims,
V = vocab_size.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from nanoeuler_core import registry

DECODE_OPS = ("embedding", "norm_linear", "decode_attention", "linear_residual", "norm_swiglu", "sample")
WEIGHT_OPS = ("norm_linear", "linear_residual", "norm_swiglu")   # the decoding ops that read bf16 weights
MAX_SEED = 2**62          # row seeds live in [0, MAX_SEED) (the sample op's RNG key)
DECODERS_PER_MODEL = 4    # decoders (KV caches, captured graphs) kept per model for later calls
PREFILL_MIN = 16          # the shortest prefill a backend that captures runs (shorter prompts are padded)
SPECULATION_MARGIN = 1.05   # a wider step must promise this much more than plain's tokens per second
                            # (its time and plain's are measured, with some noise) for the policy to take it


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else softmax(logits / temperature) within
    the top_k most likely tokens and the smallest set holding top_p of the probability."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None

    def settings(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) as the sample op reads them: top_k 0 and top_p 1 mean off."""
        return float(self.temperature), int(self.top_k or 0), float(1.0 if self.top_p is None else self.top_p)


@dataclass
class DecodeStats:
    """What a generation did: new tokens, decoding steps after the prefill (those that fed
    proposals, and steps summed over the rows still decoding), speculative proposals fed and kept,
    wall-clock seconds (prefill included), and the storage of the weights read."""

    tokens: int = 0
    steps: int = 0
    speculative_steps: int = 0
    row_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0
    rows: int = 0
    weights: str = ""

    @property
    def speculative(self) -> bool:
        return self.speculative_steps > 0

    @property
    def mode(self) -> str:
        """"plain", "speculative", or "mixed" where the policy ran both."""
        return "plain" if not self.speculative_steps else "speculative" if self.speculative_steps == self.steps \
            else "mixed"

    @property
    def acceptance(self) -> float:
        """The fraction of speculative proposals kept (0 when none were made)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One line for a log: tokens, speed, the mode, and for speculative steps the acceptance."""
        text = f"{self.tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:,.0f} tokens/s"
        text += f", {self.rows} rows" if self.rows > 1 else ""
        text += f", {self.weights} weights)" if self.weights else ")"
        if self.speculative:
            text += (f"; speculative in {self.speculative_steps}/{self.steps} steps: {self.accepted}/{self.proposed} "
                     f"proposals accepted ({self.acceptance:.0%}), {self.tokens_per_step:.2f} tokens per row and step")
        else:
            text += "; plain decoding"
        return text

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per decoding step: 1 plus the proposals it keeps."""
        return (self.row_steps + self.accepted) / self.row_steps if self.row_steps else 0.0


@dataclass
class StepInFlight:
    """A step launched on the backend whose results the host has not taken yet: it computes rows
    0..n-1 at `width`, judges `fresh` proposals drawn at that width (the rest are stale), and was
    launched for `rows` (those active then); `results()` gives its accepted counts (n,) and next
    tokens (n, width) on the host, waiting for the step if it has not run yet."""

    n: int
    width: int
    fresh: int
    rows: list["Row"]
    results: Callable[[], tuple[np.ndarray, np.ndarray]]


class Decoder:
    """Batched decoding of `batch_size` rows of one model on its backend: plain (speculative=False),
    speculative with every head (True), or the policy above (None); a batch of prompts at once
    (`generate`), or rows that start and end on their own (`admit`, `step`, `retire`). `sampling`
    is the rows' sampling where `generate` is not told another; `weights` "bf16" or "fp32" (default:
    bf16 where the backend and the decoding ops run it); `run_ahead` whether `step` launches the
    next step before it takes the results of one (see Running ahead; default: where the steps are
    captured)."""

    def __init__(self, model, batch_size: int, speculative: bool | None = None, sampling: Sampling = Sampling(),
                 capture: bool = True, weights: str | None = None, run_ahead: bool | None = None):
        cfg = model.cfg
        if speculative and cfg.n_mtp < 2:
            raise ValueError("speculative decoding needs the multi-token-prediction heads, and this model has "
                             "n_mtp = 1: pass --no-speculative (speculative=False)")
        self.model, self.cfg, self.be = model, cfg, model.backend
        self.batch, self.sampling, self.capture = batch_size, sampling, capture
        self.run_ahead = (capture and self.be.captures) if run_ahead is None else run_ahead
        self.K = 1 if speculative is False else cfg.n_mtp
        self.policy = speculative is None and self.K > 1   # else every step has width K
        self.ops = registry.kernels_on(model.backend_name, DECODE_OPS)
        self.weights = check_weights(model.backend_name, weights)
        self.S = cfg.ctx_len + self.K - 1
        self._check_memory()
        B, K, S, be = batch_size, self.K, self.S, self.be
        shape = (B, S, cfg.n_kv_heads, cfg.head_dim)
        try:
            self.caches = [(be.zeros(shape), be.zeros(shape)) for _ in range(cfg.n_layers)]
            # each row's next token and proposals, (B, W) at the current width W, and the proposals' distributions
            self.tokens = be.zeros((B * K,), dtype=np.int64)
            self.drafts = be.zeros((B * (K - 1), cfg.vocab_size))
            self.seeds, self.counters, self.pos = (be.zeros((B,), dtype=np.int64) for _ in range(3))
            # each row's sampling (the sample op's inputs): temperature in the backend's floats, top_p in float64
            self.temperature, self.top_k, self.top_p = be.zeros((B,)), be.zeros((B,), dtype=np.int64), \
                be.zeros((B,), dtype=np.float64)
            # where a step leaves its accepted counts (B,) and tokens (B*K,) for the host, in one array
            # the host reads without a copy (`host_visible`); consecutive steps alternate between two,
            # so that a step run ahead never writes the one whose results the host is taking
            self.mailboxes = [be.host_visible((B + B * K,), np.int64) for _ in range(2)]
            self._bind_weights()
        except Exception as exc:  # MemoryError on the CPU, the driver's CUDA_ERROR_OUT_OF_MEMORY on a GPU
            if isinstance(exc, MemoryError) or "OUT_OF_MEMORY" in str(exc):
                raise ValueError(self._too_large("memory free on the device")) from None
            raise
        be.copy_(self.top_p, np.ones(B))
        self.rows: list[Row | None] = [None] * B     # the row decoding in each slot, None where free
        self.greedy = np.zeros(B, dtype=bool)        # whether each row decodes greedily
        self.width = K                               # tokens per row in the device's token block
        self._pending = np.zeros((B, K), dtype=np.int64)   # per row: its next token (already kept), then proposals
        self._replays = {}                           # (rows computed, width, mailbox) -> the captured step
        self._next_mailbox = 0                       # the mailbox the next step launched writes
        self._in_flight: StepInFlight | None = None   # the step launched, its results not yet taken
        self._prefills = {}                          # prefill length -> its ids buffer, its captured forward
        self._cache_views = {}                       # (row, prefill length) -> the prefill's output, `_cache_rows`
        self._row_states = {}                        # (row, width) -> the sample op's state of that row
        self.step_seconds: dict[tuple[int, int], float] = {}   # (rows computed, width) -> a step's seconds
        # counted over the decoder's life (DecodeStats; the policy's acceptance): proposal j offered (the
        # j - 1 before it kept) and kept, at offered[j - 1] and kept[j - 1]
        self.steps = self.speculative_steps = self.row_steps = self.proposed = self.accepted = 0
        self.offered, self.kept = np.zeros(K - 1, dtype=np.int64), np.zeros(K - 1, dtype=np.int64)
        self._widths: dict = {}   # (rows, step times) -> the policy's width, for the acceptance so far

    def _check_memory(self) -> None:
        """A clear error, before allocating, for a batch whose cache and buffers cannot fit in the
        memory the backend plans with (where it has no such limit, the allocation itself tells)."""
        cfg, B = self.cfg, self.batch
        itemsize = np.dtype(self.be.dtype).itemsize
        cache = 2 * cfg.n_layers * B * self.S * cfg.n_kv_heads * cfg.head_dim * itemsize
        logits = B * self.K * self.K * cfg.vocab_size * itemsize
        activations = B * self.K * (2 * cfg.hidden_dim + 4 * cfg.dim) * itemsize
        self.bytes_needed = cache + 2 * logits + activations
        limit = self.be.memory_limit()
        if limit is not None and self.bytes_needed > limit:
            raise ValueError(self._too_large(f"{limit / 2**30:.1f} GiB of memory this machine can give it"))

    def _too_large(self, what: str) -> str:
        return (f"a batch of {self.batch} rows needs {self.bytes_needed / 2**30:.1f} GiB for its KV cache and "
                f"buffers, more than the {what}: generate fewer rows at once (--num-samples, or fewer prompts)")

    def _bind_weights(self) -> None:
        """The parameters in the shapes the decoding ops read: views of the master weights or of a
        bf16 copy (see Weights above), with the model's stacked matrices (wqkv, w_gate_up) and the
        K heads stacked by rows."""
        m = self.model
        self._own_copy = None   # a bf16 copy of the weights this decoder made, refreshed by `generate`
        flat = m.flat
        if self.weights == "bf16":
            if m.precision.storage == "bf16":
                flat = m.compute_flat   # the model keeps it current
            else:
                flat = self._own_copy = self.be.zeros(m.n_params, "bf16")
                self.be.copy_(flat, m.flat)
        self.w = SimpleNamespace(tok_emb=m.master["tok_emb"], norm=m.master["norm"],
                                 heads=m.stacked(flat, [f"heads.{j}" for j in range(self.K)]))
        self.forward_weights = m.weight_set(flat)   # the prefill's (the model's forward)
        self.layers = self.forward_weights.layers

    # ----------------------------------------------------------------------------------------
    # the forward

    def _hidden(self, ids, B: int, T: int, caches, pos):
        """Tokens ids (B*T,) at positions pos[b] + t -> the last block's output (B*T, C); their keys
        and values go into `caches`."""
        f, cfg = self.ops, self.cfg
        H, KV, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        x, _ = f.embedding.forward(ids, self.w.tok_emb)
        for L, (k_cache, v_cache) in zip(self.layers, caches):
            # attention Euler step: x = x + wo(attention(rope(q), rope(k), v)) of rmsnorm(x)
            qkv, _ = f.norm_linear.forward(x, L.attn_norm, L.wqkv, eps=eps)
            o, _ = f.decode_attention.forward(qkv.reshape(B, T, H + 2 * KV, D), k_cache, v_cache, pos,
                                              n_kv_heads=KV, theta=cfg.rope_theta)
            x, _ = f.linear_residual.forward(o.reshape(B * T, H * D), L.wo, x)
            # feed-forward Euler step: x = x + w_down(silu(w_gate h) * w_up h) of rmsnorm(x)
            act, _ = f.norm_swiglu.forward(x, L.ffn_norm, L.w_gate_up, eps=eps)
            x, _ = f.linear_residual.forward(act, L.w_down, x)
        return x

    def _state(self, first: int, n: int, W: int) -> tuple:
        """The sample op's state of rows first..first+n-1 at width W: tokens (n, W), drafts (n, W - 1, V),
        seeds, counters, pos and the sampling settings (n,)."""
        rows = slice(first, first + n)
        tokens = self.tokens[first * W:(first + n) * W].reshape(n, W)
        drafts = self.drafts[first * (W - 1):(first + n) * (W - 1)].reshape(n, W - 1, self.cfg.vocab_size)
        return (tokens, drafts) + tuple(a[rows] for a in (self.seeds, self.counters, self.pos, self.temperature,
                                                            self.top_k, self.top_p))

    def _sample(self, x, B: int, T: int, state):
        """Heads 0..W-1 on x (B*T, C), W the width of `state` (tokens, drafts, seeds, counters, pos and
        the sampling settings of B rows), then the sample op on it: the accepted counts (B,)."""
        f, cfg, W = self.ops, self.cfg, state[0].shape[1]
        logits, _ = f.norm_linear.forward(x, self.w.norm, self.w.heads[:W * cfg.vocab_size], eps=cfg.norm_eps)
        accepted, _ = f.sample.forward(logits.reshape(B, T, W, cfg.vocab_size), *state, max_pos=cfg.ctx_len)
        return accepted

    def _step(self, n: int, W: int, mailbox: int):
        """One decoding step of rows 0..n-1 at width W from the state buffers, its accepted counts and
        tokens left in that mailbox (backend work only: capturable)."""
        x = self._hidden(self.tokens[:n * W], n, W, [(k[:n], v[:n]) for k, v in self.caches], self.pos[:n])
        accepted = self._sample(x, n, W, self._state(0, n, W))
        box, B = self.mailboxes[mailbox][0], self.batch
        if W > 1:   # at width 1 every row keeps its one token
            self.be.copy_(box[:n], accepted)
        self.be.copy_(box[B:B + n * W], self.tokens[:n * W])

    def _prefill_length(self, T: int) -> int:
        """The tokens a prefill of T runs over: where the backend captures work, T padded to a power of
        two (at least PREFILL_MIN, at most the context), one captured forward per such length; else T."""
        if not (self.capture and self.be.captures):
            return T
        return min(self.cfg.ctx_len, max(PREFILL_MIN, 1 << (T - 1).bit_length()))

    def _prefill_forward(self, ids: np.ndarray):
        """The model's forward over the P token ids (host, P,): each block's keys and values
        (1, P, KV, D) and the last block's output (P, C). The ids go to a device buffer of length P;
        the forward over it is captured once per P where the backend captures (the padding past a
        prompt's T tokens changes none of the first T: attention is causal), then replayed."""
        P = len(ids)
        if P not in self._prefills:
            buffer = self.be.zeros((P,), dtype=np.int64)

            def forward():
                blocks = []
                with self.be.parallel(), self.be.computing(registry.precision(self.weights)):
                    self.model.run_blocks(buffer, P, self.forward_weights,
                                          lambda i, block: blocks.append((block.k, block.v, block.out_saved[0])))
                return [(k, v) for k, v, _ in blocks], blocks[-1][2]

            self.be.copy_(buffer, ids)
            run, result = self.be.capture(forward) if self.capture else (forward, forward())
            self._prefills[P] = buffer, run
            return result
        buffer, run = self._prefills[P]
        self.be.copy_(buffer, ids)
        return run()

    def _prefill(self, b: int, ids: list[int], generated: int) -> None:
        """Fill row b's cache with `ids` from position 0 in one pass of the model's forward (its
        matrix products over the whole prompt, in the decoding weights' precision) and draw its
        next token (and proposals, at the current width); `generated` tokens of the row came before
        (its RNG counter goes on from there)."""
        be, T = self.be, len(ids)
        padded = np.zeros(self._prefill_length(T), dtype=np.int64)
        padded[:T] = ids
        keys_values, out = self._prefill_forward(padded)
        for dst, src in self._cache_rows(b, keys_values, out):
            be.copy_(dst, src)
        last = be.zeros((1, self.cfg.dim))   # the last block's output at the last token, in float32
        be.copy_(last, out[T - 1:T])
        state = self._row_state(b, self.width)
        counters, pos = state[3:5]
        be.copy_(pos, np.array([T - 1], dtype=np.int64))
        be.copy_(counters, np.array([generated - 1], dtype=np.int64))
        self._sample(last, 1, 1, state)
        self._pending[b, :self.width] = np.array(be.to_host(state[0]))[0]

    def _cache_rows(self, b: int, keys_values, out) -> list[tuple]:
        """(row b's cache, the prefill's keys or values) pairs, flat, of every block: the P prefilled
        tokens from position 0 (those past the prompt are padding, overwritten by decoding before
        any query reads them). Made once per row and captured prefill (the same buffers each
        time): slicing device arrays costs host time, some 100 slices a prompt."""
        P, (_, KV, D) = len(out), keys_values[0][0].shape[1:]
        cached_out, pairs = self._cache_views.get((b, P), (None, None))
        if cached_out is not out:
            pairs = [(cache[b, :P].reshape(P * KV * D), new[0].reshape(P * KV * D))
                     for caches, news in zip(self.caches, keys_values) for cache, new in zip(caches, news)]
            if self.capture and self.be.captures:   # else each prefill's buffers are new
                self._cache_views[(b, P)] = out, pairs
        return pairs

    def _row_state(self, b: int, W: int) -> tuple:
        """`_state` of row b alone at width W, its views made once."""
        if (b, W) not in self._row_states:
            self._row_states[(b, W)] = self._state(b, 1, W)
        return self._row_states[(b, W)]

    def _launch(self, n: int, W: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Launch one step of rows 0..n-1 at width W (capturing it the first time); returns what gives
        its accepted counts (n,) and next tokens (n, W) on the host, once the step has run. At most
        the step before it may be in flight, its results not yet taken (see Running ahead): the two
        write different mailboxes."""
        mailbox = self._next_mailbox
        self._next_mailbox ^= 1
        replay = self._replays.get((n, W, mailbox))
        if replay is None:
            step = functools.partial(self._step, n, W, mailbox)
            replay, _ = self.be.capture(step) if self.capture else (step, step())
            self._replays[(n, W, mailbox)] = replay
        else:
            replay()
        ran, box, B = self.be.read_back([]), self.mailboxes[mailbox][1], self.batch

        def results():
            ran()
            kept = box[:n].copy() if W > 1 else np.ones(n, dtype=np.int64)
            return kept, box[B:B + n * W].reshape(n, W).copy()

        return results

    def _advance(self, n: int, W: int) -> tuple[np.ndarray, np.ndarray]:
        """Run one step of rows 0..n-1 at width W and wait for it: its accepted counts (n,) and next
        tokens (n, W) on the host."""
        return self._launch(n, W)()

    def _set_width(self, W: int) -> None:
        """Lay the rows' tokens out at width W on the device, from the host's copy (proposals never drawn
        at that width are stale ones)."""
        if W != self.width:
            self._settle()   # the host's copy must hold the tokens of the step in flight
            self.be.copy_(self.tokens[:self.batch * W], np.ascontiguousarray(self._pending[:, :W]).reshape(-1))
            self.width = W

    # ----------------------------------------------------------------------------------------
    # the policy

    def fixed_width(self) -> int:
        """The width of every step while a sampled row is active (and of unmeasured steps): K where
        the backend says a step over K tokens costs about one over 1 token, else 1 (or K where
        speculation was forced on, 1 where forced off)."""
        return self.K if not self.policy or self.be.multi_token_step_cheap else 1

    def expected_tokens(self) -> np.ndarray:
        """Expected tokens a row gains per step of width 1..K from the acceptance seen so far:
        1 + sum over i <= W - 1 of the chance that proposals 1..i are all kept."""
        rates = (self.kept + 1) / (self.offered + 1)   # optimistic start: 1 in 1
        return 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(rates))))

    def choose_width(self, n: int) -> int:
        """The width of the next step over rows 0..n-1 (see the policy in the module docstring)."""
        seconds = [self.step_seconds.get((n, W)) for W in range(1, self.K + 1)]
        if not self.policy or not self.greedy[[row.b for row in self.active_rows()]].all() or None in seconds:
            return self.fixed_width()
        key = (n, tuple(seconds))
        if key not in self._widths:   # decided again only when the acceptance or the timings change
            # tokens per second of each width, a width's time at least every narrower one's
            rates = self.expected_tokens() / np.maximum.accumulate(seconds)
            best = int(np.argmax(rates))
            self._widths[key] = 1 + best if rates[best] > SPECULATION_MARGIN * rates[0] else 1
        return self._widths[key]

    def measure(self, repeats: int = 3, rounds: int = 5) -> None:
        """Time a step of every width over every row count `step` may use (capturing it first), with the
        rows at half the context, into `step_seconds`: the fastest of `rounds` rounds that each time
        every width in turn, `repeats` steps each, so that a stall or a clock still rising falls on no
        width in particular. Every row must be free (it decodes dummy rows)."""
        self._settle()
        if self.free_rows() != list(range(self.batch)):
            raise ValueError("a decoder measures its steps with every row free: retire the rows first")
        be, B = self.be, self.batch
        be.copy_(self.temperature, np.zeros(B))
        for n in self._row_counts():
            for W in range(1, self.K + 1):   # captured (or compiled) before any is timed
                self._set_width(W)
                be.copy_(self.pos, np.full(B, self.cfg.ctx_len // 2))
                self._advance(n, W)
            fastest = {}
            for _ in range(rounds):
                for W in range(1, self.K + 1):
                    self._set_width(W)
                    be.copy_(self.pos, np.full(B, self.cfg.ctx_len // 2))
                    be.synchronize()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        self._advance(n, W)
                    fastest[W] = min(fastest.get(W, math.inf), (time.perf_counter() - start) / repeats)
            self.step_seconds |= {(n, W): seconds for W, seconds in fastest.items()}
        be.copy_(self.pos, np.full(B, self.S))   # free rows again: outside the cache

    def _row_counts(self) -> list[int]:
        """The row counts a step may compute: 1, 2, 4, ..., batch."""
        counts = [1]
        while counts[-1] < self.batch:
            counts.append(min(self.batch, 2 * counts[-1]))
        return counts

    # ----------------------------------------------------------------------------------------
    # rows: admitted, stepped, retired

    def admit(self, b: int, prompt: list[int], seed: int, sampling: Sampling, max_new_tokens: int,
              eos_id: int | None = None, on_token=None) -> "Row":
        """Start the free row b on `prompt` (token ids, 1 <= length <= ctx_len) with its own seed and
        sampling, up to max_new_tokens new tokens or the first eos_id (not included): its cache is
        prefilled and its first token kept. on_token(b, token) sees each token as it is kept, here
        and in later steps. Returns the row's progress (Row)."""
        if self.rows[b] is not None:
            raise ValueError(f"row {b} is in use: retire it first")
        if not 1 <= len(prompt) <= self.cfg.ctx_len:
            raise ValueError(f"a prompt must have 1 to {self.cfg.ctx_len} tokens, got {len(prompt)}")
        self._settle()   # the next step computes this row too: no step in flight may be left without it
        row = self.rows[b] = Row(b, list(prompt), max_new_tokens, eos_id, on_token)
        if row.active:
            temperature, top_k, top_p = sampling.settings()
            for buffer, value in ((self.seeds, seed % MAX_SEED), (self.temperature, temperature),
                                  (self.top_k, top_k), (self.top_p, top_p)):
                self.be.copy_(buffer[b:b + 1], np.array([value]))
            self.greedy[b] = temperature == 0
            if not self.greedy[b]:   # its proposals must be drawn at the width its steps will have
                self._set_width(self.fixed_width())
            self._prefill(b, row.sequence, 0)
            row.keep(self._pending[b, :1])
        return row

    def step(self) -> None:
        """One decoding step of the active rows: a row whose cache is full first slides its window
        by half a context, then each keeps its next token (speculative: and the proposals accepted
        before it). Running ahead, the step may be the one the call before launched, and the one
        after it is launched before its results are taken (see Running ahead). Does nothing when
        no row is active and no step is in flight."""
        if self._in_flight is None:
            ctx = self.cfg.ctx_len
            for row in self.active_rows():
                if row.position == ctx:  # the cache is full: slide the window by half a context
                    window = row.sequence[-max(1, ctx // 2):]
                    self._prefill(row.b, window, len(row.new))
                    row.position = len(window)
                    row.keep(self._pending[row.b, :1])
            active = self.active_rows()
            if not active:
                return
            n = self._rows_computed(active)
            W = self.choose_width(n)
            fresh = min(W, self.width) - 1   # proposals the rows drew at this width or wider (the rest are stale)
            self._set_width(W)
            self._in_flight = StepInFlight(n, W, fresh, active, self._launch(n, W))
        launched, ahead = self._in_flight, None
        if self._may_run_ahead(launched):   # the same step again, every proposal it judges drawn at its width
            ahead = StepInFlight(launched.n, launched.width, launched.width - 1, self.active_rows(),
                                 self._launch(launched.n, launched.width))
        self._in_flight = ahead   # before collecting: should on_token raise, `_settle` still finds the step ahead
        self._collect(launched)

    def _rows_computed(self, active: list["Row"]) -> int:
        """n of a step over the active rows: rows 0..n-1, a power of two covering them."""
        return min(self.batch, 1 << active[-1].b.bit_length())

    def _may_run_ahead(self, launched: StepInFlight) -> bool:
        """Whether the step after `launched`, which is in flight, may be launched before its results
        are taken: the decoder runs ahead, the next step would compute the same rows at the same
        width anyway, no row needs its window slid before it, and some row can still take tokens."""
        active = self.active_rows()
        if not self.run_ahead or not active:
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
        row ended in the step before or was retired since (the token computed for it is dropped),
        and the counts of the decoder's life go on."""
        kept, tokens = launched.results()
        W, fresh = launched.width, launched.fresh
        self.steps += 1
        self.speculative_steps += W > 1
        for row in launched.rows:
            if not row.active:
                continue
            m = int(kept[row.b])
            self.row_steps += 1
            self.proposed += W - 1
            self.accepted += m - 1
            self.offered[:min(m, fresh)] += 1   # proposal j was judged where the j - 1 before it were kept
            self.kept[:min(m - 1, fresh)] += 1
            row.position += m
            row.keep(np.concatenate((self._pending[row.b, 1:m], tokens[row.b, :1])))
            self._pending[row.b, :W] = tokens[row.b]
        if fresh > 0:   # the acceptance changed: the policy decides again
            self._widths.clear()

    def _settle(self) -> None:
        """Collect the step in flight, if any: the host then holds what the device holds, before it
        changes what a step reads."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._collect(launched)

    def retire(self, b: int) -> "Row":
        """Free row b, done or not (its tokens so far stay in the returned Row). A step in flight may
        still compute the row: it need not be waited for, since collecting it skips the row (no longer
        active), and the position written here reaches the device after that step (the backend runs
        work in the order it is queued)."""
        row, self.rows[b] = self.rows[b], None
        if row is None:
            raise ValueError(f"row {b} is free already")
        row.active = False
        self.be.copy_(self.pos[b:b + 1], np.array([self.S]))   # its later tokens fall outside the cache: no attention
        return row

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
        if self.capture and self.be.captures:
            ctx = self.cfg.ctx_len
            for P in sorted({self._prefill_length(min(ctx, 1 << i)) for i in range(ctx.bit_length() + 1)}):
                self.admit(0, [0] * P, 0, Sampling(0.0), 1)
                self.retire(0)
        if self.policy:
            self.measure()

    def active_rows(self) -> list["Row"]:
        """The rows still decoding, in row order."""
        return [row for row in self.rows if row is not None and row.active]

    def free_rows(self) -> list[int]:
        """The rows that `admit` may start, lowest first."""
        return [b for b, row in enumerate(self.rows) if row is None]

    # ----------------------------------------------------------------------------------------
    # generation

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int], eos_id: int | None = None,
                 on_token=None, stats: DecodeStats | None = None, sampling: Sampling | None = None) -> list[list[int]]:
        """New tokens for each prompt (token ids, 1 <= length <= ctx_len), up to max_new_tokens per
        row or the first eos_id (not included), row i with seeds[i] and `sampling` (default: the
        decoder's). on_token(row, token) sees each token as it is kept. A greedy call of the policy
        first measures the steps (`measure`) if they were not yet."""
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
            if self._own_copy is not None:   # the model may have learnt since
                self.be.copy_(self._own_copy, self.model.flat)
            if self.policy and sampling.temperature == 0 and (self.batch, 1) not in self.step_seconds:
                self.measure()
            try:
                for b, (prompt, seed) in enumerate(zip(prompts, seeds)):
                    rows.append(self.admit(b, prompt, seed, sampling, max_new_tokens, eos_id, on_token))
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


class Row:
    """One row's progress on the host: its tokens so far (prompt included), the new ones, where the
    next fed token goes in the cache, and whether it goes on (`finish_reason` says why not)."""

    def __init__(self, b: int, prompt: list[int], max_new_tokens: int, eos_id, on_token):
        self.b, self.sequence, self.new = b, prompt, []
        self.position = len(prompt)   # where the next fed token goes in the cache
        self.active = max_new_tokens > 0
        self.max_new_tokens, self.eos_id, self.on_token = max_new_tokens, eos_id, on_token
        self.ended_at_eos = False

    @property
    def finish_reason(self) -> str | None:
        """"stop" (it reached eos_id), "length" (max_new_tokens), or None (still decoding, or retired before either)."""
        if self.ended_at_eos:
            return "stop"
        return "length" if len(self.new) >= self.max_new_tokens else None

    def keep(self, tokens) -> None:
        """Append the tokens decoded for this row, up to `</s>` or the token budget."""
        for token in tokens.tolist():
            if not self.active:
                return
            if token == self.eos_id:
                self.active, self.ended_at_eos = False, True
                return
            self.new.append(token)
            self.sequence.append(token)
            if self.on_token is not None:
                self.on_token(self.b, token)
            if len(self.new) == self.max_new_tokens:
                self.active = False
                return


def weights_on(backend: str) -> str:
    """The default storage of the weights decoding reads: "bf16" where the backend runs bf16 and its
    decoding ops that read matrices declare bf16 there, else "fp32"."""
    runs = registry.BF16 in registry.backend(backend).precisions and \
        all("bf16" in registry.op(name).precisions_on(backend) for name in WEIGHT_OPS)
    return "bf16" if runs else "fp32"


def check_weights(backend: str, weights: str | None) -> str:
    """`weights` ("bf16", "fp32", or None for the backend's default) if decoding on `backend` can read
    them; else ValueError, one line."""
    weights = weights_on(backend) if weights is None else weights
    if weights not in ("bf16", "fp32"):
        raise ValueError(f"weights must be 'bf16' or 'fp32', got {weights!r}")
    if weights == "bf16" and weights_on(backend) != "bf16":
        raise ValueError(f"bf16 decoding weights need a backend whose decoding ops run bf16, and the "
                         f"{backend} backend's do not here: use fp32 weights")
    return weights


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
