"""Attention for decoding with a KV cache (forward only): RoPE of the new queries and keys at each
row's own positions, the new keys and values written into the cache, then causal attention of each
new query over its row of the cache.

Shapes: qkv (B, T, H + 2 KV, D), the fused projection of T new tokens per row (H query heads, then
KV key heads, then KV value heads); k_cache, v_cache (B, S, KV, D), updated in place; pos (B,) int
-> o (B, T, H, D); saved (). Attrs: n_kv_heads (KV), theta (the RoPE base).

Token t of row b sits at position p = pos[b] + t. Its query and key are rotated by RoPE at p (as
ops/qkv_rope.py: rotate half, inv_freq[j] = theta^(-2j/D)); its key and value go to
cache[b, p]; its query attends keys 0..p of row b (the row's earlier tokens, cached by earlier
calls or by this one), query head h reading key/value head h // (H / KV):

    o[b, t, h] = sum_{s <= p} softmax_s(q . k_cache[b, s] / sqrt(D)) v_cache[b, s]

Cache entries past p are never read, so stale ones (rejected speculative tokens) are harmless until
overwritten. A token whose position falls outside [0, S) is skipped: nothing is written and its o
is 0 (a row that finished while its batch decodes on). Batch-invariant (see norm_linear): o[b, t]
depends only on qkv[b, t], p and row b's cache, computed in the same order whatever B and T are.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op
from nanoeuler_ops.qkv_rope import cos_sin


def check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads):
    """Raise ValueError unless the arrays fit together (every backend calls this)."""
    if qkv.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape or pos.shape != (qkv.shape[0],):
        raise ValueError(f"decode_attention: need qkv (B, T, H + 2 KV, D), caches (B, S, KV, D) and pos (B,), got "
                         f"{qkv.shape}, {k_cache.shape}, {v_cache.shape}, {pos.shape}")
    B, T, heads, D = qkv.shape
    H, KV = heads - 2 * n_kv_heads, n_kv_heads
    if H < 1 or H % KV or k_cache.shape[0] != B or k_cache.shape[2:] != (KV, D) or D % 2:
        raise ValueError(f"decode_attention: qkv {qkv.shape} does not hold H query heads and {KV} key/value heads "
                         f"(H a multiple of {KV}) of an even size matching the caches {k_cache.shape}")


def _rotate(u, cos, sin):
    half = u.shape[-1] // 2
    return np.concatenate((u[..., :half] * cos - u[..., half:] * sin, u[..., half:] * cos + u[..., :half] * sin), -1)


def forward(qkv, k_cache, v_cache, pos, *, n_kv_heads, theta):
    check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads)
    B, T, heads, D = qkv.shape
    S, KV = k_cache.shape[1], n_kv_heads
    H = heads - 2 * KV
    cos, sin = cos_sin(S, D, theta, 0)
    o = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):  # in order: token t attends the keys of tokens t' <= t written before it
            p = int(pos[b]) + t
            if not 0 <= p < S:
                continue
            q = _rotate(qkv[b, t, :H], cos[p], sin[p])
            k_cache[b, p] = _rotate(qkv[b, t, H:H + KV], cos[p], sin[p])
            v_cache[b, p] = qkv[b, t, H + KV:]
            for h in range(H):
                keys, values = k_cache[b, :p + 1, h // (H // KV)], v_cache[b, :p + 1, h // (H // KV)]
                scores = keys @ q[h] / np.sqrt(D)
                weights = np.exp(scores - scores.max())
                o[b, t, h] = weights @ values / weights.sum()
    return o, ()


def sample_inputs(rng):
    # (B, T, S, H, KV, D, pos): one new token per row at different lengths (GQA groups of 2);
    # several new tokens (speculative proposals, a prefill) with one key/value head and with none
    # shared; a row running past the end of its cache; a group of 6 query heads (more than a GPU
    # block takes at once); a long row (the GPU's splits of 32 keys added in more than one chunk).
    cases = ((2, 1, 7, 4, 2, 4, (3, 0)), (2, 3, 9, 2, 1, 6, (0, 5)), (1, 4, 6, 2, 2, 4, (3,)),
             (3, 2, 40, 6, 3, 8, (37, 11, 0)), (1, 2, 5, 6, 1, 4, (2,)), (1, 1, 300, 2, 1, 4, (290,)))
    for b, t, s, h, kv, d, pos in cases:
        qkv = rng.standard_normal((b, t, h + 2 * kv, d))
        k_cache = rng.standard_normal((b, s, kv, d))  # entries before pos: earlier tokens; after: stale
        v_cache = rng.standard_normal((b, s, kv, d))
        yield Sample((qkv, k_cache, v_cache, np.array(pos, dtype=np.int64)), {"n_kv_heads": kv, "theta": 10000.0},
                     name=f"B{b}_T{t}_S{s}_H{h}_KV{kv}_D{d}")


def error_inputs(rng):
    # B = 2 rows of qkv (2, 1, heads, 4) with n_kv_heads = 2 against (qkv's heads, the caches' KV
    # heads and head size, pos's length): 8 heads are 4 query heads and 2 + 2 key/value heads
    shapes = r"need qkv \(B, T, H \+ 2 KV, D\), caches \(B, S, KV, D\) and pos \(B,\)"
    heads = "does not hold H query heads and 2 key/value heads"
    cases = (("pos_3_for_B2", 8, 2, 4, 3, shapes),
             ("H3_KV2", 7, 2, 4, 2, heads),            # 7 = 3 + 2 * 2: 3 query heads for 2 key/value heads
             ("caches_KV1_for_KV2", 8, 1, 4, 2, heads),
             ("caches_D6_for_D4", 8, 2, 6, 2, heads))
    for name, qkv_heads, cache_kv, cache_d, n_pos, match in cases:
        qkv = rng.standard_normal((2, 1, qkv_heads, 4))
        k_cache, v_cache = rng.standard_normal((2, 2, 6, cache_kv, cache_d))
        yield ErrorInput(Sample((qkv, k_cache, v_cache, np.zeros(n_pos, dtype=np.int64)),
                                {"n_kv_heads": 2, "theta": 10000.0}, name=name), match=match)


def model_inputs(rng, cfg, rows):
    """rows new tokens over 3 rows of a 515-position cache: one far in, one at its start, one
    running past its end."""
    B, T, S, H, KV, D = 3, rows // 3 or 1, 515, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    normal = rng.standard_normal
    return Sample((normal((B, T, H + 2 * KV, D)), normal((B, S, KV, D)), normal((B, S, KV, D)),
                   np.array([300, 0, S - 2])), {"n_kv_heads": KV, "theta": 10000.0},
                  name=f"B{B}_T{T}_S{S}_H{H}_KV{KV}_D{D}")


OP = define_op(globals(), "Decoding: RoPE at per-row positions, append to the KV cache, causal attention over it (in place, forward only)",
                inplace=(1, 2))
