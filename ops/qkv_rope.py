"""Split a fused query/key/value projection into heads and rotate the queries and keys (RoPE).

Shapes: qkv (B, T, (H + 2 KV) D), its columns the query heads, then the key heads, then the value
heads -> (q (B, T, H, D), k (B, T, KV, D), v (B, T, KV, D)); saved (). Attrs: n_heads (H),
n_kv_heads (KV), theta, start_pos (the absolute position of token 0, > 0 when decoding after a
KV cache). v is copied; q and k are rotated by RoPE, half-split ("rotate half", as Hugging Face
Llama): each head vector u (D,) at position t is rotated pairwise, pair j < D/2 made of u[j] and
u[j + D/2], by the angle t * inv_freq[j], inv_freq[j] = theta^(-2j/D):
    y[j]       = u[j] cos - u[j + D/2] sin
    y[j + D/2] = u[j + D/2] cos + u[j] sin
Backward: a rotation is orthogonal, so dqkv gathers dq and dk rotated back by the negative angle
(sin -> -sin) and dv, in the same column layout.

The model computes q, k and v with one matrix product against the stacked weights [wq; wk; wv]
(adjacent in its parameter buffer), so this op is the seam between that product and attention.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op


def cos_sin(T, D, theta, start_pos):
    """cos and sin of the RoPE angles of positions start_pos .. start_pos + T - 1, each (T, D/2), in
    float64 on every backend (so they agree); decode_attention rotates with them too."""
    if D % 2:
        raise ValueError(f"rope needs an even head dimension, got {D}")
    inv_freq = theta ** (-2.0 * np.arange(D // 2) / D)
    angles = np.arange(start_pos, start_pos + T, dtype=np.float64)[:, None] * inv_freq
    return np.cos(angles), np.sin(angles)


def rotate(x, cos, sin):
    """x (B, T, H, D) rotated pairwise by the angles whose cos and sin are (T, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2): the same angles for every head
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def _heads(qkv, n_heads, n_kv_heads):
    """qkv (B, T, (H + 2 KV) D) -> views q (B, T, H, D), k and v (B, T, KV, D)."""
    B, T, width = qkv.shape
    D = width // (n_heads + 2 * n_kv_heads)
    heads = qkv.reshape(B, T, n_heads + 2 * n_kv_heads, D)
    return heads[:, :, :n_heads], heads[:, :, n_heads:n_heads + n_kv_heads], heads[:, :, n_heads + n_kv_heads:]


def check_shape(qkv, n_heads, n_kv_heads):
    """Raise ValueError unless qkv's last axis holds H + 2 KV heads of an even size (every backend calls this)."""
    heads = n_heads + 2 * n_kv_heads
    if qkv.ndim != 3 or qkv.shape[2] % heads or (qkv.shape[2] // heads) % 2:
        raise ValueError(f"qkv_rope: need qkv (B, T, (H + 2 KV) D) with an even D for H={n_heads}, "
                         f"KV={n_kv_heads}, got shape {qkv.shape}")


def forward(qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    check_shape(qkv, n_heads, n_kv_heads)
    q, k, v = _heads(qkv, n_heads, n_kv_heads)
    cos, sin = cos_sin(qkv.shape[1], q.shape[3], theta, start_pos)
    return (rotate(q, cos, sin), rotate(k, cos, sin), v.copy()), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    dq, dk, dv = dout
    cos, sin = cos_sin(qkv.shape[1], dq.shape[3], theta, start_pos)
    B, T = dq.shape[:2]
    parts = (rotate(dq, cos, -sin), rotate(dk, cos, -sin), dv)
    return (np.concatenate([p.reshape(B, T, -1) for p in parts], axis=2),)


def sample_inputs(rng):
    # (B, T, H, KV, D, start_pos): GQA, plain multi-head, a decode-style offset, one token; rows whose
    # GPU threads take several pairs each (3-wide halves: a thread's pairs in different heads), and a
    # row of more pairs than one GPU block takes (4,096)
    for b, t, h, kv, d, start_pos in ((1, 1, 1, 1, 2, 0), (2, 5, 4, 2, 6, 0), (2, 3, 2, 2, 8, 7), (1, 4, 4, 1, 16, 123),
                                      (1, 2, 8, 4, 32, 5), (1, 2, 40, 2, 6, 0), (1, 1, 130, 2, 64, 3)):
        qkv = rng.standard_normal((b, t, (h + 2 * kv) * d))
        yield Sample((qkv,), {"n_heads": h, "n_kv_heads": kv, "theta": 10000.0, "start_pos": start_pos},
                     grad_inputs=(0,), name=f"B{b}_T{t}_H{h}_KV{kv}_D{d}_p{start_pos}")


def error_inputs(rng):
    # (width of qkv, H, KV): 36 columns are no whole number of 4 + 2 * 2 = 8 heads; 8 heads of an odd size (3)
    for name, width, h, kv in (("width_vs_heads", 36, 4, 2), ("odd_D", 8 * 3, 4, 2)):
        yield ErrorInput(Sample((rng.standard_normal((1, 2, width)),),
                                {"n_heads": h, "n_kv_heads": kv, "theta": 10000.0}, name=name),
                         match=rf"qkv_rope: need qkv \(B, T, \(H \+ 2 KV\) D\) with an even D for H={h}, KV={kv}")


def model_inputs(rng, cfg, rows):
    """rows // ctx_len sequences of ctx_len tokens (a training batch)."""
    B, T, H, KV = rows // cfg.ctx_len, cfg.ctx_len, cfg.n_heads, cfg.n_kv_heads
    qkv = rng.standard_normal((B, T, (H + 2 * KV) * cfg.head_dim))
    return Sample((qkv,), {"n_heads": H, "n_kv_heads": KV, "theta": 10000.0, "start_pos": 0}, grad_inputs=(0,),
                  name=f"B{B}_T{T}_H{H}_KV{KV}_D{cfg.head_dim}")


OP = define_op(globals(), "Split a fused q/k/v projection into heads; rotary position embedding of q and k",
                precisions={"cuda": ("bf16",)})
