"""The host's side of decoding: how a row's tokens are chosen (Sampling), a row's progress (Row),
the log-probabilities of its tokens where asked for (TokenLogprob), and what a generation did
(DecodeStats)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_SEED = 2**62          # row seeds live in [0, MAX_SEED) (the sample op's RNG key)


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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's distribution (head 0's float32 log-softmax,
    before temperature, top-k and top-p), and the `top` most likely tokens with theirs, most
    likely first: ((token, logprob), ...)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, tokens, top: int) -> list[TokenLogprob]:
    """Each tokens[i]'s TokenLogprob from logits[i] (V,) with the `top` most likely tokens."""
    z = np.asarray(logits, dtype=np.float32)
    peak = z.max(axis=-1, keepdims=True)
    logp = z - (peak + np.log(np.exp(z - peak).sum(axis=-1, keepdims=True)))
    top = min(top, logp.shape[-1])
    result = []
    for t, row in zip(tokens, logp):
        best = np.argpartition(-row, top - 1)[:top] if top else np.zeros(0, dtype=np.int64)
        best = best[np.lexsort((best, -row[best]))]   # most likely first, ties by token id
        result.append(TokenLogprob(int(t), float(row[t]), tuple((int(k), float(row[k])) for k in best)))
    return result


class Row:
    """One row's progress on the host: its tokens so far (prompt included), the new ones, where the
    next fed token goes in the cache, whether it decodes greedily, the grammar it is held to (a
    Constraint, or None), and whether it goes on (`finish_reason` says why not); where
    `top_logprobs` is not None, each new token's TokenLogprob with that many most likely tokens, in
    `logprobs`."""

    def __init__(self, b: int, prompt: list[int], max_new_tokens: int, eos_id, on_token, greedy: bool,
                 constraint=None, top_logprobs: int | None = None):
        self.b, self.sequence, self.new = b, prompt, []
        self.position = len(prompt)   # where the next fed token goes in the cache
        self.active = max_new_tokens > 0
        self.max_new_tokens, self.eos_id, self.on_token, self.greedy = max_new_tokens, eos_id, on_token, greedy
        self.constraint = constraint
        self.end_ids = {eos_id, None if constraint is None else constraint.eos_id} - {None}
        self.stopped = False
        self.top_logprobs, self.logprobs = top_logprobs, []

    @property
    def finish_reason(self) -> str | None:
        """"stop" (it reached an end token, or its grammar's end), "length" (max_new_tokens), or None
        (still decoding, or retired before either)."""
        if self.stopped:
            return "stop"
        return "length" if len(self.new) >= self.max_new_tokens else None

    def keep(self, tokens, logits=None) -> None:
        """Append the tokens decoded for this row, up to `</s>` (or the end of its grammar) or the
        token budget; `logits` (host, (len(tokens), V)): the head-0 logits each was drawn from, where
        the row wants logprobs."""
        for i, token in enumerate(tokens.tolist()):
            if not self.active:
                return
            if token in self.end_ids:
                self.active, self.stopped = False, True
                return
            if self.constraint is not None:
                self.constraint.accept(token)
            self.new.append(token)
            self.sequence.append(token)
            if self.top_logprobs is not None:
                self.logprobs += token_logprobs(logits[i:i + 1], [token], self.top_logprobs)
            if self.on_token is not None:
                self.on_token(self.b, token)
            if self.constraint is not None and self.constraint.complete:
                self.active, self.stopped = False, True
                return
            if len(self.new) == self.max_new_tokens:
                self.active = False
                return


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

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per decoding step: 1 plus the proposals it keeps."""
        return (self.row_steps + self.accepted) / self.row_steps if self.row_steps else 0.0

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
