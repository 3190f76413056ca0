"""Steps launched on the backend and their results coming back to the host through two mailboxes,
so that one step may run while the host takes the results of the one before (docs/decoding.md,
"Running ahead")."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class StepInFlight:
    """A step launched on the backend whose results the host has not taken yet: it computes rows
    0..n-1 at `width`, judges `fresh` proposals drawn at that width (the rest are stale), and was
    launched for `rows` (those active then); `results()` gives its accepted counts (n,) and next
    tokens (n, width) on the host, waiting for the step if it has not run yet; `logits` (n*width,
    width*V) on the backend, which no later step overwrites before the one after next is launched."""

    n: int
    width: int
    fresh: int
    rows: list
    results: Callable[[], tuple[np.ndarray, np.ndarray]]
    logits: object


class StepLauncher:
    """Launches `forward`'s steps over `cache`, each captured the first time it runs over n rows at
    width W into a mailbox (where `capture`; the backend decides what capturing means), then
    replayed. A mailbox is an int64 array the host reads without a copy (`host_visible`): the
    accepted counts (B,), then the tokens (B*K,). Consecutive steps alternate between two, so
    that a step launched while the one before is in flight never writes the mailbox whose results
    the host is taking."""

    def __init__(self, be, forward, cache, capture: bool):
        self.be, self.forward, self.cache, self.capture = be, forward, cache, capture
        B, K = cache.batch, cache.K
        self.mailboxes = [be.host_visible((B + B * K,), np.int64) for _ in range(2)]   # (device, host) each
        self.replays = {}        # (rows computed, width, mailbox) -> the captured step
        self._next_mailbox = 0   # the mailbox the next step launched writes

    def launch(self, n: int, W: int) -> tuple[Callable[[], tuple[np.ndarray, np.ndarray]], object]:
        """Launch one step of rows 0..n-1 at width W; returns what gives its accepted counts (n,) and
        next tokens (n, W) on the host, once the step has run, and its logits on the backend. At most
        the step before it may be in flight, its results not yet taken: the two write different
        mailboxes (and, captured, different logits)."""
        mailbox = self._next_mailbox
        self._next_mailbox ^= 1
        replay = self.replays.get((n, W, mailbox))
        if replay is None:
            step = functools.partial(self.forward.step, self.cache, n, W, self.mailboxes[mailbox][0])
            replay, logits = self.be.capture(step) if self.capture else (step, step())
            self.replays[(n, W, mailbox)] = replay
        else:
            logits = replay()
        ran, box, B = self.be.read_back([]), self.mailboxes[mailbox][1], self.cache.batch

        def results():
            ran()
            kept = box[:n].copy() if W > 1 else np.ones(n, dtype=np.int64)
            return kept, box[B:B + n * W].reshape(n, W).copy()

        return results, logits

    def run(self, n: int, W: int) -> tuple[np.ndarray, np.ndarray]:
        """Run one step of rows 0..n-1 at width W and wait for it: its accepted counts (n,) and next
        tokens (n, W) on the host."""
        return self.launch(n, W)[0]()
