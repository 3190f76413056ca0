"""Causal scaled dot-product attention with grouped key/value heads (GQA).

Shapes: q (B, T, H, D), k (B, S, KV, D), v (B, S, KV, D) -> o (B, T, H, D); saved (o, lse (B, H, T)).
S >= T: the T queries are the last T positions of the S keys (S > T is decoding with a KV cache),
so query t sits at absolute position S - T + t and attends the keys s <= S - T + t.
Query head h reads key/value head h // (H // KV). With scale = 1 / sqrt(D), for one (b, h):

    scores[t, s] = scale * q[t] . k[s]            (-inf where s > S - T + t)
    lse[t] = log(sum_s exp(scores[t, s]))
    P[t, s] = exp(scores[t, s] - lse[t])
    o[t] = sum_s P[t, s] v[s]

Backward (FlashAttention-2: P is recomputed from lse, never stored), with Di[t] = do[t] . o[t]:

    dv[s] = sum_{t, h in group} P[t, s] do[t]
    dS[t, s] = P[t, s] * (do[t] . v[s] - Di[t])
    dq[t] = scale * sum_s dS[t, s] k[s]
    dk[s] = scale * sum_{t, h in group} dS[t, s] q[t]

This reference builds the full (T, S) score matrix for clarity; the backends never do.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op


def _grouped(q, kv_heads):
    """q (B, T, H, D) viewed as (B, T, KV, G, D): query head h = kv_head * G + g reads kv_head."""
    B, T, H, D = q.shape
    return q.reshape(B, T, kv_heads, H // kv_heads, D)


def _probs(q, k, lse=None):
    """Softmax probabilities P (B, KV, G, T, S) and lse (B, KV, G, T) of the causal scores."""
    T, S, D = q.shape[1], k.shape[1], q.shape[3]
    scores = np.einsum("btkgd,bskd->bkgts", _grouped(q, k.shape[2]), k) / np.sqrt(D)
    future = np.arange(S)[None, :] > (S - T) + np.arange(T)[:, None]
    scores = np.where(future, -np.inf, scores)
    if lse is None:
        top = scores.max(axis=-1, keepdims=True)
        lse = (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]
    return np.exp(scores - lse[..., None]), lse


def check_shapes(q, k, v):
    """Raise ValueError unless q (B, T, H, D), k and v (B, S, KV, D) fit together (every backend calls this)."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"attention: need q (B, T, H, D) and k, v (B, S, KV, D) of one shape, "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    (B, T, H, D), (Bk, S, KV, Dk) = q.shape, k.shape
    if (B, D) != (Bk, Dk):
        raise ValueError(f"attention: q {q.shape} and k {k.shape} differ in batch or head size")
    if H % KV:
        raise ValueError(f"attention: {H} query heads are not a multiple of {KV} key/value heads")
    if S < T:
        raise ValueError(f"attention: {S} keys cannot serve {T} causal queries (need S >= T)")


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    probs, lse = _probs(q, k)
    o = np.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H, D)
    return o, (o, lse.reshape(B, H, T))


def backward(do, saved, q, k, v):
    o, lse = saved
    B, T, H, D = q.shape
    KV = k.shape[2]
    probs, _ = _probs(q, k, lse.reshape(B, KV, H // KV, T))
    do_g, q_g = _grouped(do, KV), _grouped(q, KV)
    di = np.einsum("btkgd,btkgd->bkgt", do_g, _grouped(o, KV))
    dv = np.einsum("bkgts,btkgd->bskd", probs, do_g)
    dscores = probs * (np.einsum("btkgd,bskd->bkgts", do_g, v) - di[..., None]) / np.sqrt(D)
    dq = np.einsum("bkgts,bskd->btkgd", dscores, k).reshape(B, T, H, D)
    dk = np.einsum("bkgts,btkgd->bskd", dscores, q_g)
    return dq, dk, dv


def sample_inputs(rng):
    # (B, T, S, H, KV, D): plain multi-head with two batch rows and two key/value heads (the batch
    # and head indices cannot be confused) decoding T > 1 queries after a KV cache (S > T), at a head
    # size the kernels pad (6); GQA with groups of 2 over two key/value heads decoding one query
    # (T = 1), and with groups of 4; one query and one key; sequence lengths that are not a multiple
    # of any kernel block, and two tiles of query rows and of keys (67). In bf16 two cases: one for
    # the CUDA backend's float32-arithmetic kernels (head size 8) and one for its tensor-core kernels
    # (head size a multiple of 16, two tiles of rows). The CUDA simulator's cost is about 30 s a
    # case (one block of 256 simulated threads per (batch row, head) and tile, whatever the sizes):
    # each case checks what no other does.
    cases = ((2, 3, 11, 2, 2, 6, "fp32"), (1, 1, 9, 4, 2, 8, "fp32"), (1, 7, 7, 4, 1, 4, "fp32"),
             (1, 1, 1, 1, 1, 4, "fp32"), (1, 67, 67, 2, 1, 4, "fp32"), (1, 5, 5, 4, 2, 8, "bf16"),
             (1, 67, 67, 4, 2, 16, "bf16"))
    for b, t, s, h, kv, d, *precisions in cases:
        q = rng.standard_normal((b, t, h, d))
        k = rng.standard_normal((b, s, kv, d))
        v = rng.standard_normal((b, s, kv, d))
        yield Sample((q, k, v), grad_inputs=(0, 1, 2), name=f"B{b}_T{t}_S{s}_H{h}_KV{kv}_D{d}",
                     precisions=tuple(precisions))


def error_inputs(rng):
    # (q shape, k and v shape, what the refusal says)
    cases = (("H3_KV2", (1, 4, 3, 8), (1, 4, 2, 8), "3 query heads are not a multiple of 2 key/value heads"),
             ("S3_T4", (1, 4, 2, 8), (1, 3, 1, 8), "3 keys cannot serve 4 causal queries"),
             ("D8_vs_D6", (1, 4, 2, 8), (1, 4, 1, 6), "differ in batch or head size"),
             ("q_3d", (4, 2, 8), (1, 4, 1, 8), r"need q \(B, T, H, D\)"))
    for name, q_shape, kv_shape, match in cases:
        q, k, v = rng.standard_normal(q_shape), rng.standard_normal(kv_shape), rng.standard_normal(kv_shape)
        yield ErrorInput(Sample((q, k, v), name=name), match=match)


def model_inputs(rng, cfg, rows):
    """rows // ctx_len sequences of ctx_len tokens (a training batch)."""
    B, T, D = rows // cfg.ctx_len, cfg.ctx_len, cfg.head_dim
    normal = rng.standard_normal
    q, k, v = normal((B, T, cfg.n_heads, D)), normal((B, T, cfg.n_kv_heads, D)), normal((B, T, cfg.n_kv_heads, D))
    return Sample((q, k, v), grad_inputs=(0, 1, 2), name=f"B{B}_T{T}_H{cfg.n_heads}_KV{cfg.n_kv_heads}_D{D}")


OP = define_op(globals(), "Causal softmax attention with grouped key/value heads, queries at the end of the keys",
                precisions={"cuda": ("bf16",)})
