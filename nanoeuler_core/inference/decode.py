"""Decoding: the model's forward for generation, a batched KV cache, and the step loop, plain or
self-speculative with the multi-token-prediction heads.

One `Decoder` serves one model and one batch size. It holds, on the model's backend, a KV cache
(B, S, KV, D) per block and the decoding state: the tokens to feed next (B, K), each row's
position and RNG counter and seed (B,), and the proposals' distributions (B, K - 1, V). A step
is backend work only, built from registered ops:

    embedding -> per block: norm_linear (q, k, v) -> decode_attention (RoPE, cache, attention)
                 -> linear_residual (wo) -> norm_swiglu (gate, up) -> linear_residual (w_down)
    -> norm_linear (final norm, heads) -> sample (verify, draw, advance the state)

so the backend captures it once (a CUDA graph on the GPU) and replays it; only the accepted
counts and the next tokens come back to the host each step. The prompt is prefilled in one pass
per row (not captured: its length varies).

Plain decoding feeds one token per row and step, and uses head 0. Speculative decoding (K =
n_mtp heads) feeds the K tokens [next, proposal 1, ..., proposal K-1], where proposal j came from
head j at the row's last position; `sample` keeps the proposals head 0 agrees with (exactly
speculative sampling when sampling) and draws the next token and proposals from the last kept
position. Entries cached for refused proposals are overwritten by later steps before any query
can read them (a query at position p reads keys 0..p only).

Batch invariance. Every decoding op computes a row with the same operations in the same order
whatever the batch, the number of tokens fed with it, or its place among them. So a token's
logits are bit for bit the same decoded alone, in a batch, after a one-pass prefill, or among
speculative proposals: greedy speculative output equals plain greedy output exactly, and a row
of a batch equals the same prompt decoded alone (sampling too: each row has its own RNG stream).

Context. A prompt may fill the whole context (ctx_len tokens); a longer one is an error. When a
row's next token would sit at position ctx_len, its cache is refilled with the last ctx_len // 2
tokens of the row and decoding goes on (plain and speculative refill at the same token, so they
still agree). The cache has K - 1 positions of slack past ctx_len where a speculative step may
write proposals that are never kept.

Shapes: B rows, K tokens fed per step (1 plain, n_mtp speculative), S = ctx_len + K - 1 cache
positions, C = dim, H query heads, KV key/value heads of D dims, V = vocab_size.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from nanoeuler_core import registry

DECODE_OPS = ("embedding", "norm_linear", "decode_attention", "linear_residual", "norm_swiglu", "sample")
MAX_SEED = 2**62          # row seeds live in [0, MAX_SEED) (the sample op's RNG key)
DECODERS_PER_MODEL = 4    # decoders (KV caches, captured graphs) kept per model for later calls


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else softmax(logits / temperature) within
    the top_k most likely tokens and the smallest set holding top_p of the probability."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None

    def attrs(self) -> dict:
        return {"temperature": float(self.temperature), "top_k": int(self.top_k or 0),
                "top_p": float(1.0 if self.top_p is None else self.top_p)}


@dataclass
class DecodeStats:
    """What a generation did: new tokens, decoding steps after the prefill (and steps summed over
    the rows still decoding), speculative proposals offered and kept, and wall-clock seconds
    (prefill included)."""

    tokens: int = 0
    steps: int = 0
    row_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0
    speculative: bool = False
    rows: int = 0

    @property
    def acceptance(self) -> float:
        """The fraction of speculative proposals kept (0 when none were made)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One line for a log: tokens, speed, and for speculative decoding the acceptance."""
        text = f"{self.tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:,.0f} tokens/s"
        text += f", {self.rows} rows)" if self.rows > 1 else ")"
        if self.speculative:
            text += (f"; speculative: {self.accepted}/{self.proposed} proposals accepted ({self.acceptance:.0%}), "
                     f"{self.tokens_per_step:.2f} tokens per row and step")
        return text

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per decoding step: 1 plus the proposals it keeps."""
        return (self.row_steps + self.accepted) / self.row_steps if self.row_steps else 0.0


class Decoder:
    """Batched decoding of `batch_size` rows of one model, plain or speculative, on its backend."""

    def __init__(self, model, batch_size: int, speculative: bool, sampling: Sampling, capture: bool = True):
        cfg = model.cfg
        if speculative and cfg.n_mtp < 2:
            raise ValueError("speculative decoding needs the multi-token-prediction heads, and this model has "
                             "n_mtp = 1: pass --no-speculative (speculative=False)")
        self.model, self.cfg, self.be = model, cfg, model.backend
        self.batch, self.speculative, self.sampling, self.capture = batch_size, speculative, sampling, capture
        self.K = cfg.n_mtp if speculative else 1
        self.ops = registry.kernels_on(model.backend_name, DECODE_OPS)
        self.attrs = {**sampling.attrs(), "max_pos": cfg.ctx_len}
        self.S = cfg.ctx_len + self.K - 1
        self._check_memory()
        B, K, S, be = batch_size, self.K, self.S, self.be
        shape = (B, S, cfg.n_kv_heads, cfg.head_dim)
        try:
            self.caches = [(be.zeros(shape), be.zeros(shape)) for _ in range(cfg.n_layers)]
            self.tokens = be.zeros((B, K), dtype=np.int64)
            self.drafts = be.zeros((B, K - 1, cfg.vocab_size))
            self.seeds, self.counters, self.pos = (be.zeros((B,), dtype=np.int64) for _ in range(3))
            self._bind_weights()
        except Exception as exc:  # MemoryError on the CPU, the driver's CUDA_ERROR_OUT_OF_MEMORY on a GPU
            if isinstance(exc, MemoryError) or "OUT_OF_MEMORY" in str(exc):
                raise ValueError(self._too_large("memory free on the device")) from None
            raise
        self.state = (self.tokens, self.drafts, self.seeds, self.counters, self.pos)
        self._replay = None

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
        """The parameters in the shapes the decoding ops read: views of the master weights, with the
        model's stacked matrices (wqkv, w_gate_up) and the K heads stacked by rows."""
        m = self.model
        self.w = SimpleNamespace(tok_emb=m.master["tok_emb"], norm=m.master["norm"],
                                 heads=m.stacked(m.flat, [f"heads.{j}" for j in range(self.K)]))
        self.layers = m.block_weights(m.flat)

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

    def _sample(self, x, B: int, T: int, state):
        """Heads on x (B*T, C), then the sample op on `state` (tokens, drafts, seeds, counters, pos
        of B rows): the accepted counts (B,)."""
        f, cfg = self.ops, self.cfg
        logits, _ = f.norm_linear.forward(x, self.w.norm, self.w.heads, eps=cfg.norm_eps)
        accepted, _ = f.sample.forward(logits.reshape(B, T, self.K, cfg.vocab_size), *state, **self.attrs)
        return accepted

    def _step(self):
        """One decoding step of every row from the state buffers (backend work only: capturable)."""
        B, K = self.batch, self.K
        x = self._hidden(self.tokens.reshape(B * K), B, K, self.caches, self.pos)
        return self._sample(x, B, K, self.state)

    def _prefill(self, b: int, ids: list[int], generated: int) -> None:
        """Fill row b's cache with `ids` from position 0 in one pass and draw its next token (and
        proposals); `generated` tokens of the row came before (its RNG counter goes on from there)."""
        be, rows, T = self.be, slice(b, b + 1), len(ids)
        state = tuple(a[rows] for a in self.state)
        tokens, drafts, seeds, counters, pos = state
        be.copy_(pos, np.zeros(1, dtype=np.int64))
        x = self._hidden(be.asarray(np.asarray(ids, dtype=np.int64)), 1, T, [(k[rows], v[rows]) for k, v in self.caches],
                         pos)
        be.copy_(pos, np.array([T - 1], dtype=np.int64))
        be.copy_(counters, np.array([generated - 1], dtype=np.int64))
        self._sample(x[T - 1:T], 1, 1, state)

    def _advance(self) -> np.ndarray:
        """Run one step (capturing it the first time); the accepted counts (B,) on the host."""
        if self._replay is None:
            replay, accepted = self.be.capture(self._step) if self.capture else (self._step, self._step())
            self._replay = replay
        else:
            accepted = self._replay()
        return np.array(self.be.to_host(accepted))

    # ----------------------------------------------------------------------------------------
    # generation

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int], eos_id: int | None = None,
                 on_token=None, stats: DecodeStats | None = None) -> list[list[int]]:
        """New tokens for each prompt (token ids, 1 <= length <= ctx_len), up to max_new_tokens per
        row or the first eos_id (not included). on_token(row, token) sees each token as it is kept."""
        if len(prompts) != self.batch or len(seeds) != self.batch:
            raise ValueError(f"this decoder takes {self.batch} prompts and seeds, got {len(prompts)} and {len(seeds)}")
        start = time.perf_counter()
        rows = [_Row(b, list(prompt), max_new_tokens, eos_id, on_token) for b, prompt in enumerate(prompts)]
        with self.be.serial():
            steps, row_steps, accepted = self._decode(rows, seeds)
        if stats is not None:
            stats.tokens += sum(len(row.new) for row in rows)
            stats.steps += steps
            stats.row_steps += row_steps
            stats.proposed += row_steps * (self.K - 1)
            stats.accepted += accepted
            stats.seconds += time.perf_counter() - start
            stats.speculative = self.speculative
            stats.rows = max(stats.rows, self.batch)
        return [row.new for row in rows]

    def _decode(self, rows: list["_Row"], seeds: list[int]) -> tuple[int, int, int]:
        """Prefill, then step until every row is done; returns (steps, steps summed over the rows
        decoding, proposals kept)."""
        ctx, be = self.cfg.ctx_len, self.be
        be.copy_(self.seeds, np.array([seed % MAX_SEED for seed in seeds], dtype=np.int64))
        for row in rows:
            if row.active:
                self._prefill(row.b, row.sequence, 0)
        pending = np.array(be.to_host(self.tokens))  # per row: the next token (already kept), then proposals
        for row in rows:
            row.keep(pending[row.b, :1])
        steps = row_steps = accepted = 0
        while True:
            for row in rows:
                if row.active and row.position == ctx:  # the cache is full: slide the window by half a context
                    window = row.sequence[-max(1, ctx // 2):]
                    self._prefill(row.b, window, len(row.new))
                    row.position = len(window)
                    pending[row.b] = np.array(be.to_host(self.tokens[row.b:row.b + 1]))[0]
                    row.keep(pending[row.b, :1])
            if not any(row.active for row in rows):
                return steps, row_steps, accepted
            kept = self._advance()
            tokens = np.array(be.to_host(self.tokens))
            steps += 1
            for row in rows:
                if row.active:
                    m = int(kept[row.b])
                    row_steps += 1
                    accepted += m - 1
                    row.position += m
                    row.keep(np.concatenate((pending[row.b, 1:m], tokens[row.b, :1])))
            pending = tokens


class _Row:
    """One row's progress on the host: its tokens so far, the new ones, and whether it goes on."""

    def __init__(self, b: int, prompt: list[int], max_new_tokens: int, eos_id, on_token):
        self.b, self.sequence, self.new = b, prompt, []
        self.position = len(prompt)   # where the next fed token goes in the cache
        self.active = max_new_tokens > 0
        self.max_new_tokens, self.eos_id, self.on_token = max_new_tokens, eos_id, on_token

    def keep(self, tokens) -> None:
        """Append the tokens decoded for this row, up to `</s>` or the token budget."""
        for token in tokens.tolist():
            if not self.active or token == self.eos_id:
                self.active = False
                return
            self.new.append(token)
            self.sequence.append(token)
            if self.on_token is not None:
                self.on_token(self.b, token)
            if len(self.new) == self.max_new_tokens:
                self.active = False
                return


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_for(model, batch_size: int, speculative: bool, sampling: Sampling) -> Decoder:
    """The model's decoder for this batch size, mode and sampling, made on first use and kept
    (with its KV cache and captured step) for later calls; the least recently used go first."""
    decoders = _DECODERS.setdefault(model, {})
    key = (batch_size, speculative, sampling)
    decoder = decoders.pop(key, None)
    if decoder is None:
        while len(decoders) >= DECODERS_PER_MODEL:
            decoders.pop(next(iter(decoders)))
        decoder = Decoder(model, batch_size, speculative, sampling)
    decoders[key] = decoder
    return decoder
