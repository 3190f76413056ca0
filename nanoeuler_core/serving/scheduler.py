"""Continuous batching: one thread owns a Decoder of `max_batch` rows and decodes every request
through it, so concurrent requests share each decoding step.

    scheduler = Scheduler(model, tok, max_batch=8, max_queue=64).start()
    job = Job(prompts=[ids], n=2, max_tokens=16, sampling=Sampling(0.8), seed=1, stop=["\\n"],
              eos_id=tok.eos_id, emit=events.append)   # emit: receives the job's events (see `deliver`)
    scheduler.submit(job)       # QueueFull past max_queue waiting jobs, ShuttingDown after close()
    scheduler.cancel(job)       # its client went away: its rows are freed at once
    scheduler.close()

A job asks for `n` choices of each of its prompts; choice i (numbered prompt by prompt) decodes in
a row of its own with seed + i, so it is exactly what `generate(prompt, seed=seed + i)` gives alone
(the decoding ops are batch-invariant and each row has its own random stream).

The loop, on its own thread (the server's event loop stays free): read the messages that came in
(new jobs, cancellations), start waiting choices in free rows (the lowest first, as many as the
decoder has staging rows for), run one chunk of the prompts being prefilled (at most
PREFILL_TOKENS tokens over them all, after the longest prefix the decoder's prefix cache holds:
docs/decoding.md, "Prefill"), then one step of every active row, so that a long prompt or many
new ones never stall the rows decoding; then for each row turn its new tokens into text (whole
UTF-8 characters), look for the stop strings, and send the text on; a row is retired when its
choice ends (max_tokens: "length"; the end-of-text or end-of-turn token, or a stop string: "stop")
or its job is cancelled. Choices wait in arrival order; a job counts against max_queue until its
last choice has a row. A job with a grammar (structured outputs) holds each choice's row to it. With nothing to do the thread sleeps on its inbox.

How events reach the jobs is `scheduler.deliver`'s business: it is called on the scheduler's thread
with the events of one step, [(job, event), ...], and by default hands each to job.emit right away;
a server sets it to pass them all to its event loop at once. Events a job receives, in order:
Prompt(index, logprobs) per prompt where the job asks for the prompt's log-probabilities; Text(index,
text, finish_reason, logprobs) pieces of each choice's text, the last one of a choice with its
finish_reason, then Done(prompt_tokens, completion_tokens); or Failed(message) (the server is
shutting down, or decoding failed), after which nothing more comes.

Log-probabilities: a job with `logprobs` (a count of most likely tokens) decodes its choices in
rows that bring their logits to the host (Decoder.admit's top_logprobs); each Text carries the
TokenLogprob of the tokens whose text begins in it (at the end: every token whose text begins
before a stop string). A job with `prompt_logprobs` has its prompts scored as `nanoeuler-run eval`
scores text (Model.token_logprobs), on this thread, before its choices wait for rows.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from nanoeuler_core.inference.constraint import Constraint
from nanoeuler_core.inference.decoder import Decoder, Sampling
from nanoeuler_core.inference.decoder.rows import TokenLogprob, token_logprobs
from nanoeuler_core.inference.generate import TextStream

log = logging.getLogger("nanoeuler.serving")


class QueueFull(Exception):
    """max_queue jobs are already waiting for a row."""


class ShuttingDown(Exception):
    """The scheduler is closing: it takes no new jobs."""


@dataclass(frozen=True)
class Text:
    """More of choice `index`'s text (whole characters, never a stop string nor what may begin one);
    with a finish_reason, its last: "stop" (its end token or a stop string) or "length" (max_tokens).
    Where the job asks for logprobs: the tokens whose text begins in this piece, each as (where its
    text begins in the choice's text, its TokenLogprob)."""
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: tuple[tuple[int, TokenLogprob], ...] = ()


@dataclass(frozen=True)
class Prompt:
    """The log-probabilities of prompt `index`'s tokens given the tokens before them (None for the
    first), as `nanoeuler-run eval` scores them; where the job asks (prompt_logprobs)."""
    index: int
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True)
class Done:
    """Every choice of the job ended; its token counts (OpenAI's usage)."""
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The job ends unfinished, and why (the server shuts down, decoding failed)."""
    message: str


@dataclass(eq=False)
class Job:
    """One request: n choices of each prompt (token ids, each fitting the context)."""

    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    seed: int
    stop: list[str]                  # strings that end a choice's text (not included in it)
    eos_id: int | None               # the token that ends a choice (not included)
    emit: Callable[[object], None]   # receives the job's events, where `Scheduler.deliver` hands them over
    logprobs: int | None = None          # the choices' tokens' log-probabilities, with this many most likely
    prompt_logprobs: int | None = None   # the prompts' tokens' log-probabilities, with this many most likely
    grammar: str | None = None           # each choice's text is JSON of this grammar (inference/constraint.py)
    choices_left: int = field(init=False, default=0)
    waiting: int = field(init=False, default=0)     # choices without a row yet
    closed: bool = field(init=False, default=False)  # done, failed or cancelled: no more events
    completion_tokens: int = field(init=False, default=0)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


class _Choice:
    """One choice of a job decoding in a row: its text so far, held back where it might be the
    start of a stop string."""

    def __init__(self, job: Job, index: int, tok):
        self.job, self.index = job, index
        self.prompt = job.prompts[index // job.n]
        self.stream = TextStream(tok, self._add_text)
        self.text, self.sent, self.tokens = "", 0, 0
        self.stopped = False        # a stop string was found: the text ends before it
        self.scored: list[tuple[int, TokenLogprob]] = []   # (where its text begins, its TokenLogprob)
        self.scored_sent = 0

    def add_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        if not self.stopped:
            self.tokens += 1
            if logprob is not None:
                self.scored.append((len(self.text), logprob))
            self.stream.add(token)

    def _add_text(self, piece: str) -> None:
        if self.stopped:
            return
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.job.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def unsent(self, final: bool = False) -> tuple[str, tuple]:
        """The text not sent yet, less (unless final) a tail that a stop string may start with; and
        the scored tokens whose text begins in it (`Text.logprobs`)."""
        if final and not self.stopped:
            self.stream.finish()
        end = len(self.text)
        if not (final or self.stopped):
            end -= max((k for s in self.job.stop for k in range(min(len(s) - 1, end - self.sent), 0, -1)
                        if self.text.endswith(s[:k])), default=0)
        piece, self.sent = self.text[self.sent:end], end
        return piece, self._unsent_logprobs(end, final and not self.stopped)

    def _unsent_logprobs(self, end: int, all_left: bool) -> tuple:
        """The scored tokens not sent yet whose text begins before `end` (all of them with all_left)."""
        last = len(self.scored) if all_left else \
            next((i for i in range(self.scored_sent, len(self.scored)) if self.scored[i][0] >= end), len(self.scored))
        tokens, self.scored_sent = tuple(self.scored[self.scored_sent:last]), last
        return tokens


class Scheduler:
    """Continuous batching over one Decoder of `max_batch` rows (see the module docstring)."""

    def __init__(self, model, tok, max_batch: int, max_queue: int, speculative: bool = False,
                 weights: str | None = None, prefix_cache_tokens: int | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.tok, self.max_batch, self.max_queue = tok, max_batch, max_queue
        self.decoder = Decoder(model, max_batch, speculative, weights=weights, prefix_cache_tokens=prefix_cache_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Choice] = collections.deque()
        self._rows: dict[int, _Choice] = {}           # row -> the choice decoding in it
        self._lock = threading.Lock()
        self._queued = 0                              # jobs waiting for a row (max_queue bounds them)
        self._closing = False
        self._started, self._start_error = threading.Event(), None
        self._outbox: list[tuple[Job, object]] = []   # events of the current step, for `deliver`
        self.deliver: Callable[[list[tuple[Job, object]]], None] = emit_each
        self._thread = threading.Thread(target=self._run, name="nanoeuler-scheduler", daemon=True)

    # ----------------------------------------------------------------------------------------
    # the other threads' side

    def start(self) -> "Scheduler":
        """Start the thread, which first compiles and captures the decoding steps (so that the first
        request does not pay for it); returns once it serves."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        return self

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull if max_queue jobs wait already, ShuttingDown once closing."""
        with self._lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} requests are waiting already (--max-queue {self.max_queue}): "
                                f"try again shortly")
            self._queued += 1
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Stop `job` (its client went away): its waiting choices leave the queue, its rows are freed."""
        self._inbox.put(("cancel", job))

    def drain(self) -> None:
        """Take no more jobs (ShuttingDown); those submitted go on to their end."""
        with self._lock:
            self._closing = True

    def close(self, timeout: float | None = 10.0) -> None:
        """Take no more jobs, fail the ones still running, and stop the thread."""
        with self._lock:
            self._closing = True
        self._inbox.put(("close", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def prefix_stats(self) -> dict:
        """The decoder's prefix cache counts (PrefixCache.stats: prefix_cache_hits, prefix_tokens_reused,
        ...), for a server's metrics; read from any thread (counters only)."""
        return self.decoder.prefix_cache.stats()

    def load(self) -> dict:
        """Rows in use and jobs waiting, for /health."""
        return {"rows": self.max_batch, "active": len(self._rows), "waiting": self._queued}

    # ----------------------------------------------------------------------------------------
    # the scheduler's thread

    def _run(self) -> None:
        with self.decoder.be.serial():   # all the decoder's work on this one thread, kernels included
            try:
                self.decoder.warm_up()
            except Exception as exc:
                self._start_error = exc
                return
            finally:
                self._started.set()
            while self._read_inbox(block=not self._rows and not self._waiting):
                try:
                    self._admit()
                    self._send()
                    self._flush()   # a new row's first token goes out before the step
                    if self.decoder.active_rows():
                        self.decoder.step()
                    self._send()
                except Exception:   # a bug or a device error: the jobs in the rows fail, the server goes on
                    log.exception("decoding failed")
                    for choice in list(self._rows.values()):
                        self._fail(choice.job, "decoding failed on the server (see its log)")
                self._flush()
        for job in {choice.job for choice in [*self._rows.values(), *self._waiting]}:
            self._fail(job, "the server is shutting down")
        self._flush()

    def _flush(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.deliver(events)

    def _read_inbox(self, block: bool) -> bool:
        """Handle the messages that came in (waiting for one if `block`); False once closed."""
        try:
            kind, job = self._inbox.get(block=block)
            while True:
                if kind == "close":
                    return False
                if kind == "submit":
                    self._enqueue(job)
                elif kind == "cancel":
                    self._drop(job)
                kind, job = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _enqueue(self, job: Job) -> None:
        job.choices_left = job.waiting = job.choices
        self._waiting.extend(_Choice(job, i, self.tok) for i in range(job.choices))
        self._score_prompts(job)

    def _score_prompts(self, job: Job) -> None:
        """A Prompt event per prompt of a job that asks for its prompts' log-probabilities."""
        if job.prompt_logprobs is None:
            return
        try:
            for i, ids in enumerate(job.prompts):
                self._outbox.append((job, Prompt(i, prompt_logprobs(self.decoder.model, ids, job.prompt_logprobs))))
        except Exception:   # as a failed decoding step: this job fails, the server goes on
            log.exception("scoring a prompt failed")
            self._fail(job, "scoring the prompt failed on the server (see its log)")

    def _admit(self) -> None:
        """Start waiting choices in the free rows, lowest first, while the decoder has staging rows
        for their prompts; then one chunk of the prompts under way (the rows it finishes decode from
        the next step on)."""
        decoder = self.decoder
        free = decoder.free_rows()
        while self._waiting and free and decoder.can_start():
            choice, b = self._waiting.popleft(), free.pop(0)
            job = choice.job
            self._rows[b] = choice
            decoder.start(b, choice.prompt, job.seed + choice.index, job.sampling, job.max_tokens, job.eos_id,
                          lambda b, token, choice=choice: choice.add_token(token, self._latest_logprob(b)),
                          self._constraint(job), job.logprobs)
            job.waiting -= 1
            if job.waiting == 0:
                self._dequeued()
        if decoder.admitting:
            decoder.prefill_chunk()

    def _constraint(self, job: Job) -> Constraint | None:
        """What holds a choice of `job` to its grammar (a matcher of its own), or None."""
        if job.grammar is None:
            return None
        return Constraint(job.grammar, self.tok, self.tok.eos_id if job.eos_id is None else job.eos_id)

    def _send(self) -> None:
        """Each row's new text to its job; finished choices retired (and their jobs completed)."""
        for b, choice in list(self._rows.items()):
            row, job = self.decoder.rows[b], choice.job
            if row is None:   # its prompt is still being prefilled
                continue
            done = choice.stopped or not row.active
            piece, logprobs = choice.unsent(final=done)
            if not done:
                if piece or logprobs:
                    self._outbox.append((job, Text(choice.index, piece, None, logprobs)))
                continue
            self.decoder.retire(b)
            del self._rows[b]
            reason = "stop" if choice.stopped else row.finish_reason
            self._outbox.append((job, Text(choice.index, piece, reason, logprobs)))
            job.completion_tokens += choice.tokens
            job.choices_left -= 1
            if job.choices_left == 0:
                job.closed = True
                self._outbox.append((job, Done(sum(len(p) for p in job.prompts), job.completion_tokens)))

    def _latest_logprob(self, b: int) -> TokenLogprob | None:
        """The TokenLogprob of row b's latest token, where its job asks for them."""
        row = self.decoder.rows[b]
        return row.logprobs[-1] if row.top_logprobs is not None else None

    def _drop(self, job: Job) -> None:
        """Remove every trace of `job`: waiting choices and rows."""
        if job.closed:
            return
        job.closed = True
        if job.waiting:
            self._waiting = collections.deque(c for c in self._waiting if c.job is not job)
            job.waiting = 0
            self._dequeued()
        for b in [b for b, choice in self._rows.items() if choice.job is job]:
            if self.decoder.rows[b] is not None or b in self.decoder.admitting:   # (not if its admission failed)
                self.decoder.retire(b)
            del self._rows[b]

    def _fail(self, job: Job, message: str) -> None:
        if not job.closed:
            self._drop(job)
            self._outbox.append((job, Failed(message)))

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1


def emit_each(events: list[tuple[Job, object]]) -> None:
    """Hand each event to its job (Scheduler.deliver's default, and what a server's event loop runs)."""
    for job, event in events:
        job.emit(event)


def prompt_logprobs(model, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Each token of `ids` given those before it (None for the first): its log-probability as
    `nanoeuler-run eval` scores text (Model.token_logprobs: eval/text_loss.py, eval/hellaswag.py),
    and the `top` most likely tokens from the model's logits, the token itself (where among them)
    with that same log-probability, so that it compares equal to the token's own."""
    if len(ids) < 2:
        return [None] * len(ids)
    inputs, targets = np.array([ids[:-1]]), np.array([ids[1:]])
    scored = model.token_logprobs(inputs, targets)[0]
    tops = [entry.top for entry in token_logprobs(model.forward(inputs)[0], ids[1:], top)] if top else \
        [()] * len(scored)
    return [None] + [TokenLogprob(t, float(lp), tuple((k, float(lp) if k == t else v) for k, v in best))
                     for t, lp, best in zip(ids[1:], scored, tops)]
