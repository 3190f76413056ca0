"""One transformer block of a decoding step (forward only): the attention Euler step over the KV
cache, then the feed-forward Euler step, as the decoding ops compute them one after another.

Shapes: x (B, T, C), the residual stream of T new tokens per row; attn_norm (C,), wqkv
((H + 2 KV) D, C); k_cache, v_cache (B, S, KV, D), updated in place; pos (B,) int; wo (C, H D);
ffn_norm (C,); w_gate_up (2F, C) = [w_gate; w_up]; w_down (C, F) -> y (B, T, C); saved ().
Attrs: n_kv_heads (KV), theta (the RoPE base), eps.

    qkv = norm_linear(x, attn_norm, wqkv)                       rmsnorm(x) @ wqkv.T
    o   = decode_attention(qkv, k_cache, v_cache, pos)          RoPE, cache append, causal attention
    h   = linear_residual(o, wo, x)                             x + o @ wo.T
    act = norm_swiglu(h, ffn_norm, w_gate_up)                   silu(n @ w_gate.T) * (n @ w_up.T), n = rmsnorm(h)
    y   = linear_residual(act, w_down, h)                       h + act @ w_down.T

Each part is the op of that name (see them for the details: token t of row b sits at position
pos[b] + t, a position outside [0, S) is skipped). A backend may compute the block in one piece (the
GPU's is one launch) or as those ops one by one (`composed`); either way batch-invariant, as every
decoding op: row b's y depends only on its x, pos[b] and its cache, computed in the same order
whatever B and T are.
"""

import numpy as np

from nanoeuler_core.registry import Sample, define_op
from nanoeuler_ops import decode_attention, linear_residual, norm_linear, norm_swiglu


def check_shapes(x, attn_norm, wqkv, k_cache, v_cache, pos, wo, ffn_norm, w_gate_up, w_down, n_kv_heads):
    """Raise ValueError unless the arrays fit together (every backend calls this)."""
    if x.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"decode_block: need x (B, T, C) and caches (B, S, KV, D), got {x.shape}, {k_cache.shape}")
    B, T, C = x.shape
    D = k_cache.shape[3]
    norm_linear.check_shapes(x.reshape(B * T, C), attn_norm, wqkv)
    if wqkv.shape[0] % D:
        raise ValueError(f"decode_block: wqkv {wqkv.shape} does not hold whole heads of size {D}")
    decode_attention.check_shapes(np.empty((B, T, wqkv.shape[0] // D, D)), k_cache, v_cache, pos, n_kv_heads)
    HD = wqkv.shape[0] - 2 * n_kv_heads * D
    linear_residual.check_shapes(np.empty((B * T, HD)), wo, x.reshape(B * T, C))
    norm_swiglu.check_shapes(x.reshape(B * T, C), ffn_norm, w_gate_up)
    linear_residual.check_shapes(np.empty((B * T, w_gate_up.shape[0] // 2)), w_down, x.reshape(B * T, C))


def composed(norm_linear_forward, decode_attention_forward, linear_residual_forward, norm_swiglu_forward):
    """The block's forward as the four decoding ops' forwards (one backend's) called in turn."""

    def forward(x, attn_norm, wqkv, k_cache, v_cache, pos, wo, ffn_norm, w_gate_up, w_down, *, n_kv_heads, theta,
                eps):
        check_shapes(x, attn_norm, wqkv, k_cache, v_cache, pos, wo, ffn_norm, w_gate_up, w_down, n_kv_heads)
        B, T, C = x.shape
        D = k_cache.shape[3]
        rows = x.reshape(B * T, C)
        qkv, _ = norm_linear_forward(rows, attn_norm, wqkv, eps=eps)
        o, _ = decode_attention_forward(qkv.reshape(B, T, wqkv.shape[0] // D, D), k_cache, v_cache, pos,
                                        n_kv_heads=n_kv_heads, theta=theta)
        h, _ = linear_residual_forward(o.reshape(B * T, o.shape[2] * D), wo, rows)
        act, _ = norm_swiglu_forward(h, ffn_norm, w_gate_up, eps=eps)
        y, _ = linear_residual_forward(act, w_down, h)
        return y.reshape(B, T, C), ()

    return forward


forward = composed(norm_linear.forward, decode_attention.forward, linear_residual.forward, norm_swiglu.forward)


def sample_inputs(rng):
    # (B, T, C, H, KV, D, F, S, pos): one token per row at different lengths with GQA groups of 2, a
    # hidden layer wider than a lane's 64 features, a row past the end of its cache; several tokens
    # per row (speculative proposals) with one key/value head, the one checked in bf16 too (the
    # simulated kernel is slow).
    cases = ((3, 1, 24, 4, 2, 6, 70, 40, (37, 0, 40), ("fp32",)), (2, 3, 16, 2, 1, 8, 12, 9, (0, 5), ("fp32", "bf16")))
    for b, t, c, h, kv, d, f, s, pos, precisions in cases:
        scale = c ** -0.5
        yield Sample((rng.standard_normal((b, t, c)), 1.0 + 0.1 * rng.standard_normal(c),
                      scale * rng.standard_normal(((h + 2 * kv) * d, c)),
                      rng.standard_normal((b, s, kv, d)), rng.standard_normal((b, s, kv, d)), np.array(pos),
                      (h * d) ** -0.5 * rng.standard_normal((c, h * d)), 1.0 + 0.1 * rng.standard_normal(c),
                      2.0 * scale * rng.standard_normal((2 * f, c)), f ** -0.5 * rng.standard_normal((c, f))),
                     {"n_kv_heads": kv, "theta": 10000.0, "eps": 1e-5}, name=f"B{b}_T{t}_C{c}_H{h}_KV{kv}_D{d}_F{f}",
                     precisions=precisions)


OP = define_op(globals(), "Decoding: one transformer block (attention and feed-forward Euler steps over the KV cache; "
                          "in place, forward only)", inplace=(3, 4), precisions={"cuda": ("bf16",)})
