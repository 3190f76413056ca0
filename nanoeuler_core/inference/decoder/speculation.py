"""Which width a decoding step runs, from step timings and acceptance counts alone (no model, no
device): the policy of docs/decoding.md, "Speculation"."""

from __future__ import annotations

import numpy as np

SPECULATION_MARGIN = 1.05   # a wider step must promise this much more than plain's tokens per second
                            # (its time and plain's are measured, with some noise) for the policy to take it


class SpeculationPolicy:
    """The width W in 1..K (tokens fed per row: the next one and W - 1 proposals) of each step.

    Fixed (adaptive=False: plain or speculation forced), every step runs `fixed_width()`. Adaptive,
    a step over n rows that all decode greedily runs the width with the most expected tokens per
    second, (1 + expected proposals kept) / t(n, W), where that beats plain's (W = 1) by
    SPECULATION_MARGIN; a step with a sampled row, or over n rows whose steps are not all timed,
    runs `fixed_width()`.

        step_seconds  (n, W) -> seconds of a step of width W over n rows (told, or measured by the decoder)
        offered[j-1]  steps that judged proposal j with the j - 1 before it kept
        kept[j-1]     those that kept it
    """

    def __init__(self, K: int, adaptive: bool, multi_token_step_cheap: bool):
        self.K, self.adaptive, self.multi_token_step_cheap = K, adaptive, multi_token_step_cheap
        self.step_seconds: dict[tuple[int, int], float] = {}
        self.offered, self.kept = np.zeros(K - 1, dtype=np.int64), np.zeros(K - 1, dtype=np.int64)
        self._widths: dict = {}   # (rows, step times) -> the width, for the acceptance so far

    def fixed_width(self) -> int:
        """The width of every step while a sampled row is active (and of untimed steps): K where a
        step over K tokens costs about one over 1 token, else 1 (or K where speculation is forced
        on, 1 where forced off: K = 1)."""
        return self.K if not self.adaptive or self.multi_token_step_cheap else 1

    def expected_tokens(self) -> np.ndarray:
        """Expected tokens a row gains per step of width 1..K from the acceptance seen so far:
        1 + sum over i <= W - 1 of the chance that proposals 1..i are all kept."""
        rates = (self.kept + 1) / (self.offered + 1)   # optimistic start: 1 in 1
        return 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(rates))))

    def width(self, n: int, greedy: bool) -> int:
        """The width of the next step over n rows; `greedy`: whether every row it computes decodes greedily."""
        seconds = [self.step_seconds.get((n, W)) for W in range(1, self.K + 1)]
        if not self.adaptive or not greedy or None in seconds:
            return self.fixed_width()
        key = (n, tuple(seconds))
        if key not in self._widths:   # decided again only when the acceptance or the timings change
            # tokens per second of each width, a width's time at least every narrower one's: a wider step
            # does a narrower one's work and more (a time measured below it is noise)
            rates = self.expected_tokens() / np.maximum.accumulate(seconds)
            best = int(np.argmax(rates))
            self._widths[key] = 1 + best if rates[best] > SPECULATION_MARGIN * rates[0] else 1
        return self._widths[key]

    def record(self, kept: list[int], fresh: int) -> None:
        """Count a step's acceptance: `kept` holds, for each row it decoded, the tokens it kept
        (1 + the proposals kept), and the step judged `fresh` proposals drawn at its width (the
        rest were stale: the narrower step before it drew none there)."""
        for m in kept:
            self.offered[:min(m, fresh)] += 1   # proposal j was judged where the j - 1 before it were kept
            self.kept[:min(m - 1, fresh)] += 1
        if fresh > 0:   # the acceptance changed: decide again
            self._widths.clear()
