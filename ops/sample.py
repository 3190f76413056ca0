"""Choosing the next tokens while decoding (forward only): plain sampling, and the verification
step of self-speculative decoding with the multi-token-prediction heads.

Shapes: logits (B, T, K, V), the K heads' logits at the T tokens just fed to each row;
tokens (B, K) int, in place: the T fed tokens in tokens[:, :T] (T <= K), the next ones out;
drafts (B, K - 1, V), in place: the distributions the fed proposals were drawn from, the new
ones out; seeds, counters, pos (B,) int, counters and pos in place; each row's sampling:
temperature (B,) float (0 = greedy), top_k (B,) int (0 = off), top_p (B,) float (1 = off);
mask (B, ceil(V / 32)) int32, the tokens each row may produce (bit v % 32 of word v // 32 set: token
v allowed; every bit set: no constraint) -> accepted (B,) int; saved (). Attrs: max_pos.

Sampling is per row, an input rather than an attribute, so that rows decoding for different
requests (a server's continuous batching) share one step, and a captured step reads whatever the
rows' settings are when it is replayed. So is the mask: a row held to a grammar (structured
outputs) and free rows share one step. A token the mask leaves out has logit -inf in every one of
the row's distributions (head 0's and the drafts', before top-k and top-p): probability 0 at any
temperature, never a greedy pick; a row's mask must allow at least one token.

For row b, tokens[b, 0] is final (it was drawn from head 0) and tokens[b, 1:T] are proposals:
tokens[b, i] was drawn from drafts[b, i - 1] (head i at the row's previous position) and is
checked against head 0's distribution at the token before it, logits[b, i - 1, 0]:

    greedy:   kept if it is head 0's argmax there;
    sampling: kept with probability min(1, p(y) / q(y)) (p: head 0's distribution, q: the draft's);
              the first one refused is replaced by a draw from normalize(max(0, p - q)).

The fed tokens kept, accepted[b] = m >= 1, are tokens[b, 0] and the proposals before the first
refusal, capped so that pos[b] + m <= max_pos (at least 1). The output is the next token (the
replacement, or a draw from head 0 at the last kept token, logits[b, m - 1, 0]) in tokens[b, 0],
and K - 1 new proposals, head j's draws at that token, in tokens[b, j] (their distributions in
drafts[b, j - 1]); counters[b] and pos[b] advance by m. This keeps the output distribution exactly
head 0's (speculative sampling: Leviathan et al. 2023, Chen et al. 2023), and greedy output
exactly plain greedy decoding's. With K = T = 1 it is plain sampling.

Distributions: softmax(logits / temperature) over the top_k largest logits (ties at the k-th
kept), then over the most likely tokens holding top_p of the mass (every token at least as likely
as the least likely one needed). Greedy (a row at temperature 0) takes the first largest logit; that row's drafts are then
neither read nor written. A draw with uniform u in [0, 1) takes the first token whose cumulative weight,
in vocabulary order, exceeds u times the total.

Randomness is counter-based, the same on every backend: counters[b] is the index, among the
tokens generated for row b, of tokens[b, 0] (-1: the prompt's last token), and the uniform
deciding generated token n for a given purpose is uniform(seeds[b], n, stream). A row's output
thus depends only on its own seed, logits and tokens, never on the batch around it.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op

STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
MAX_SEED = 2**62   # seeds lie in [0, MAX_SEED)
M32 = np.uint64(0xFFFFFFFF)


def uniform(seed, counter, stream):
    """A uniform float64 in [0, 1) from (seed, counter, stream), 0 <= seed < 2^62, 0 <= counter < 2^32.

    Five rounds of the lowbias32 integer hash (C. Wellons) over the 32-bit words of the key, in
    uint64 arithmetic whose products stay below 2^64: the same bits in NumPy, Numba and CUDA.
    The backends compile this very function.
    """
    s = np.uint64(seed)
    before_last = h = np.uint64(0x9E3779B9)
    for word in (np.uint64(stream), s & M32, s >> np.uint64(32), np.uint64(counter) & M32, np.uint64(0x85EBCA6B)):
        before_last = h
        h ^= word
        h ^= h >> np.uint64(16)
        h = (h * np.uint64(0x7FEB352D)) & M32
        h ^= h >> np.uint64(15)
        h = (h * np.uint64(0x846CA68B)) & M32
        h ^= h >> np.uint64(16)
    return np.float64((before_last << np.uint64(21)) | (h >> np.uint64(11))) * (1.0 / 9007199254740992.0)


def mask_words(V: int) -> int:
    """Words of 32 bits in a row's mask over V tokens."""
    return (V + 31) // 32


def check_args(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask):
    """Raise ValueError unless shapes fit together, and where the sampling settings are host arrays,
    unless they are valid (every backend calls this; a device's arrays are its caller's to check)."""
    if logits.ndim != 4:
        raise ValueError(f"sample: logits must be (B, T, K, V), got {logits.shape}")
    B, T, K, V = logits.shape
    if mask.shape != (B, mask_words(V)):
        raise ValueError(f"sample: logits {logits.shape} need a mask of (B, ceil(V / 32)) = {(B, mask_words(V))} "
                         f"words, got {mask.shape}")
    if tokens.shape != (B, K) or drafts.shape != (B, K - 1, V) or T > K or \
            not seeds.shape == counters.shape == pos.shape == temperature.shape == top_k.shape == top_p.shape == (B,):
        raise ValueError(f"sample: logits {logits.shape} need tokens (B, K), drafts (B, K - 1, V), seeds, counters, "
                         f"pos, temperature, top_k and top_p (B,) with T <= K; got {tokens.shape}, {drafts.shape}, "
                         f"{seeds.shape}, {counters.shape}, {pos.shape}, {temperature.shape}, {top_k.shape}, "
                         f"{top_p.shape}")
    if all(isinstance(a, np.ndarray) for a in (temperature, top_k, top_p)) and \
            not (np.all(temperature >= 0) and np.all(top_k >= 0) and np.all((0 < top_p) & (top_p <= 1))):
        raise ValueError(f"sample: need temperature >= 0, top_k >= 0, 0 < top_p <= 1 in every row; got "
                         f"{temperature}, {top_k}, {top_p}")


def allowed(mask_row, V: int) -> np.ndarray:
    """The tokens a row's mask (ceil(V / 32),) allows, bool (V,)."""
    v = np.arange(V)
    return ((np.asarray(mask_row, dtype=np.int64)[v >> 5] >> (v & 31)) & 1).astype(bool)


def warped(logits, temperature, top_k, top_p):
    """The distribution a token is drawn from (see the module docstring), float64 (V,)."""
    z = np.asarray(logits, dtype=np.float64)
    keep = np.ones(z.size, dtype=bool)
    if 0 < top_k < z.size:
        keep = z >= np.sort(z)[z.size - top_k]
    zt = z / temperature
    p = np.where(keep, np.exp(zt - zt[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        ranked = np.sort(p)[::-1]
        reached = np.nonzero(np.cumsum(ranked) >= top_p)[0]
        threshold = ranked[reached[0]] if reached.size else 0.0
        p = np.where(p >= threshold, p, 0.0)
        p /= p.sum()
    return p


def draw(weights, u):
    """The first index whose cumulative weight exceeds u times the total."""
    cum = np.cumsum(weights)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return i if i < weights.size else int(np.nonzero(weights)[0][-1])


def forward(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask, *, max_pos):
    check_args(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask)
    B, T, K, V = logits.shape
    accepted = np.empty(B, dtype=np.int64)
    temperatures, top_ks, top_ps = temperature, top_k, top_p
    for b in range(B):
        z = np.where(allowed(mask[b], V), np.asarray(logits[b], dtype=np.float64), -np.inf)   # (T, K, V), masked
        seed, n = int(seeds[b]), int(counters[b])
        temperature, top_k, top_p = float(temperatures[b]), int(top_ks[b]), float(top_ps[b])
        greedy = temperature == 0
        m, following = 1, None
        for i in range(1, max(1, min(T, max_pos - int(pos[b])))):
            y = int(tokens[b, i])
            if greedy:
                best = int(np.argmax(z[i - 1, 0]))
                if y != best:
                    following = best
                    break
            else:
                p, q = warped(z[i - 1, 0], temperature, top_k, top_p), drafts[b, i - 1]
                if not uniform(seed, n + i, STREAM_ACCEPT) * q[y] < p[y]:
                    residual = np.maximum(p - q, 0.0)
                    following = draw(residual if residual.sum() > 0 else p, uniform(seed, n + i, STREAM_RESIDUAL))
                    break
            m += 1
        if following is None:
            head0 = z[m - 1, 0]
            following = int(np.argmax(head0)) if greedy else \
                draw(warped(head0, temperature, top_k, top_p), uniform(seed, n + m, STREAM_SAMPLE))
        tokens[b, 0] = following
        for j in range(1, K):
            if greedy:
                tokens[b, j] = int(np.argmax(z[m - 1, j]))
            else:
                drafts[b, j - 1] = warped(z[m - 1, j], temperature, top_k, top_p)
                tokens[b, j] = draw(drafts[b, j - 1], uniform(seed, n + m + j, STREAM_DRAFT))
        counters[b] += m
        pos[b] += m
        accepted[b] = m
    return accepted, ()


def sample_inputs(rng):
    # (B, T, K, V, temperature, top_k, top_p, allowed), the sampling settings of each row (one value:
    # every row's) and the share of tokens its mask allows (1: every bit set, no constraint): plain
    # greedy and plain sampling (T = K = 1); the first draw after a prompt (T = 1, K = 3, top-k and
    # top-p); speculative steps, greedy and sampled, with proposals that head 0 agrees with, proposals
    # it does not, and a row capped by max_pos; rows of different settings in one batch (greedy beside
    # sampled and filtered; greedy beside sampled in speculative steps); masked rows (a greedy row's
    # favourite left out, top-k over fewer allowed tokens than k, V not a multiple of 32) beside free
    # ones, plain and speculative. (top-k and top-p are few: they bisect over 32 bits on the GPU, slow
    # on the simulator.)
    cases = ((3, 1, 1, 13, 0.0, 0, 1.0, 1.0), (2, 1, 1, 13, 0.9, 0, 1.0, 1.0), (1, 1, 3, 11, 1.0, 5, 0.9, 1.0),
             (4, 3, 3, 7, 0.0, 0, 1.0, 1.0), (4, 4, 4, 9, 0.8, 0, 1.0, 1.0), (2, 3, 3, 10, 1.3, 4, 1.0, 1.0),
             (3, 1, 1, 13, (0.0, 0.9, 1.2), (0, 4, 0), (1.0, 1.0, 0.8), 1.0),
             (4, 3, 3, 9, (0.8, 0.0, 1.3, 0.0), 0, 1.0, 1.0),
             (4, 1, 1, 70, (0.0, 1.0, 0.9, 0.0), (0, 0, 5, 0), 1.0, (0.1, 0.2, 0.1, 1.0)),
             (3, 1, 2, 45, (1.0, 0.7, 0.0), (6, 0, 0), (1.0, 0.9, 1.0), (0.05, 0.3, 0.3)),
             (4, 3, 3, 40, (0.0, 0.9, 0.0, 1.1), 0, 1.0, (0.3, 0.3, 1.0, 0.5)))
    for b, t, k, v, temperature, top_k, top_p, share in cases:
        temperature, top_k, top_p, share = (np.broadcast_to(np.asarray(x, dtype), b).copy() for x, dtype in
                                            ((temperature, np.float64), (top_k, np.int64), (top_p, np.float64),
                                             (share, np.float64)))
        logits = 2.0 * rng.standard_normal((b, t, k, v))
        mask = np.stack([row_mask(rng, v, s, np.argmax(logits[row, 0, 0])) for row, s in enumerate(share)])
        masked = np.stack([np.where(allowed(mask[row], v), logits[row], -np.inf) for row in range(b)])
        drafts = np.stack([[warped(z, temperature[row] or 1.0, top_k[row], top_p[row])
                            for z in 2.0 * rng.standard_normal((k - 1, v))] for row in range(b)]).reshape(b, k - 1, v)
        tokens = rng.integers(0, v, (b, k))
        for row in range(b):  # row r's first r proposals are head 0's (greedy) or the drafts' (sampling) favourites
            greedy = temperature[row] == 0
            for i in range(1, min(t, row + 1)):
                tokens[row, i] = np.argmax(masked[row, i - 1, 0]) if greedy else np.argmax(drafts[row, i - 1])
            for i in range(row + 1, t):
                if greedy and tokens[row, i] == np.argmax(masked[row, i - 1, 0]):
                    tokens[row, i] = (tokens[row, i] + 1) % v
        seeds = rng.integers(0, MAX_SEED, b)
        counters = rng.integers(-1, 50, b)
        pos = rng.integers(0, 20, b)
        pos[-1] = 25
        max_pos = 27  # the last row may keep at most 2 of its fed tokens
        mixed = "mixed" if len(set(temperature.tolist())) > 1 else f"t{temperature[0]}"
        masks = "_masked" if np.any(share < 1) else ""
        yield Sample((logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask),
                     {"max_pos": max_pos}, name=f"B{b}_T{t}_K{k}_V{v}_{mixed}{masks}")


def row_mask(rng, V: int, share: float, favourite: int) -> np.ndarray:
    """A row's mask (ceil(V / 32),) int32 allowing about `share` of V tokens, at least one, and not
    `favourite` (unless share is 1: every bit set); the bits past V at random (they are never read)."""
    if share >= 1:
        return np.full(mask_words(V), -1, dtype=np.int32)
    bits = rng.random(32 * mask_words(V)) < share
    bits[favourite] = False
    if not bits[:V].any():
        bits[(favourite + 1) % V] = True
    bits[V:] = rng.random(bits.size - V) < 0.5
    return np.packbits(bits, bitorder="little").view(np.int32)


def error_inputs(rng):
    # a step of B = 2 rows, T = 1 token, K = 2 heads over V = 5 tokens, spoilt one way at a time
    B, K, V = 2, 2, 5

    def step(tokens=(B, K), t=1, temperature=(0.0, 0.8), top_p=(1.0, 1.0), words=1):
        return (rng.standard_normal((B, t, K, V)), np.zeros(tokens, dtype=np.int64), np.full((B, K - 1, V), 1 / V),
                np.arange(B), np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64),
                np.array(temperature), np.zeros(B, dtype=np.int64), np.array(top_p), np.full((B, words), -1, np.int32))

    shapes = r"sample: logits \(2, \d, 2, 5\) need tokens \(B, K\)"
    settings = "need temperature >= 0, top_k >= 0, 0 < top_p <= 1 in every row"
    for name, inputs, match, host_values in (("tokens_K3", step(tokens=(B, K + 1)), shapes, False),
                                             ("T3_over_K2", step(t=3), shapes, False),
                                             ("mask_2_words", step(words=2), r"need a mask of \(B, ceil\(V / 32\)\)",
                                              False),
                                             ("temperature_negative", step(temperature=(0.0, -1.0)), settings, True),
                                             ("top_p_0", step(top_p=(1.0, 0.0)), settings, True)):
        yield ErrorInput(Sample(inputs, {"max_pos": 100}, name=name), match=match, host_values=host_values)


OP = define_op(globals(), "Decoding: draw next tokens under per-row token masks; verify speculative proposals "
                          "(speculative sampling), counter-based RNG", inplace=(1, 2, 4, 5))
