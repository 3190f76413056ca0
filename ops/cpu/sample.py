"""Choosing the next tokens on the CPU. See ops/sample.py for the rules and the random
numbers; rows are handled one after another on one thread (a few hundred to a few thousand
logits each)."""

import numpy as np
from numba import njit

from nanoeuler_ops import sample as spec
from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.sample import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, STREAM_SAMPLE, check_args

_uniform = njit(cache=True)(spec.uniform)


@njit(cache=True)
def _masked(z, mask_row, out):
    # z (V,) logits, mask_row (ceil(V/32),) -> out (V,): z where the mask allows, -inf elsewhere
    for i in range(z.shape[0]):
        out[i] = z[i] if (mask_row[i >> 5] >> (i & 31)) & 1 else -np.inf
    return out


@njit(cache=True)
def _warp(z, temperature, top_k, top_p, p):
    # z (V,) logits -> p (V,) the distribution to draw from (see ops/sample.py)
    V = z.shape[0]
    threshold = -np.inf
    if 0 < top_k < V:
        threshold = np.sort(z)[V - top_k]
    top = -np.inf
    for i in range(V):
        if z[i] >= threshold:
            top = max(top, z[i] / temperature)
    total = 0.0
    for i in range(V):
        e = np.exp(z[i] / temperature - top) if z[i] >= threshold else np.float32(0.0)
        p[i] = e
        total += e
    for i in range(V):
        p[i] = p[i] / total
    if top_p < 1:
        ranked = np.sort(p)[::-1]
        cut = np.float32(0.0)
        cum = 0.0
        for i in range(V):
            cum += ranked[i]
            if cum >= top_p:
                cut = ranked[i]
                break
        total = 0.0
        for i in range(V):
            if p[i] < cut:
                p[i] = 0.0
            total += p[i]
        for i in range(V):
            p[i] = p[i] / total


@njit(cache=True)
def _draw(weights, u):
    # weights (V,) >= 0 -> the first index whose cumulative weight exceeds u * total
    total = 0.0
    for i in range(weights.shape[0]):
        total += weights[i]
    target = u * total
    cum = 0.0
    last = 0
    for i in range(weights.shape[0]):
        if weights[i] > 0:
            last = i
            cum += weights[i]
            if cum > target:
                return i
    return last


@njit(cache=True)
def _sample(logits, tokens, drafts, seeds, counters, pos, temperatures, top_ks, top_ps, mask, max_pos, accepted, p,
            residual, z):
    # logits (B, T, K, V), tokens (B, K), drafts (B, K-1, V), seeds, counters, pos (B,), each row's
    # temperature, top_k, top_p (B,), mask (B, ceil(V/32)) -> accepted (B,); tokens, drafts,
    # counters, pos updated; p, residual, z (V,) scratch (z: the masked logits read)
    B, T, K, V = logits.shape
    for b in range(B):
        seed, n = seeds[b], counters[b]
        temperature, top_k, top_p = np.float32(temperatures[b]), np.int64(top_ks[b]), np.float64(top_ps[b])
        greedy = temperature == 0
        m = 1
        following = -1
        for i in range(1, max(1, min(T, max_pos - pos[b]))):
            y = tokens[b, i]
            if greedy:
                best = np.argmax(_masked(logits[b, i - 1, 0], mask[b], z))
                if y != best:
                    following = best
                    break
            else:
                _warp(_masked(logits[b, i - 1, 0], mask[b], z), temperature, top_k, top_p, p)
                q = drafts[b, i - 1]
                if not _uniform(seed, n + i, STREAM_ACCEPT) * q[y] < p[y]:
                    mass = 0.0
                    for v in range(V):
                        residual[v] = max(p[v] - q[v], np.float32(0.0))
                        mass += residual[v]
                    u = _uniform(seed, n + i, STREAM_RESIDUAL)
                    following = _draw(residual, u) if mass > 0 else _draw(p, u)
                    break
            m += 1
        if following < 0:
            if greedy:
                following = np.argmax(_masked(logits[b, m - 1, 0], mask[b], z))
            else:
                _warp(_masked(logits[b, m - 1, 0], mask[b], z), temperature, top_k, top_p, p)
                following = _draw(p, _uniform(seed, n + m, STREAM_SAMPLE))
        tokens[b, 0] = following
        for j in range(1, K):
            if greedy:
                tokens[b, j] = np.argmax(_masked(logits[b, m - 1, j], mask[b], z))
            else:
                _warp(_masked(logits[b, m - 1, j], mask[b], z), temperature, top_k, top_p, drafts[b, j - 1])
                tokens[b, j] = _draw(drafts[b, j - 1], _uniform(seed, n + m + j, STREAM_DRAFT))
        counters[b] = n + m
        pos[b] += m
        accepted[b] = m


def forward(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask, *, max_pos):
    check_args(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask)
    V = logits.shape[3]
    accepted = np.empty(logits.shape[0], dtype=np.int64)
    BACKEND.launch(_sample, logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask, int(max_pos),
                   accepted, np.empty(V, dtype=logits.dtype), np.empty(V, dtype=logits.dtype),
                   np.empty(V, dtype=logits.dtype))
    return accepted, ()
