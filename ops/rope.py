"""Rotary position embedding, half-split ("rotate half", as Hugging Face Llama).

Shapes: x (B, T, H, D) -> y (B, T, H, D); saved (). Attrs: theta (the base), start_pos (the
absolute position of x[:, 0], > 0 when decoding after a KV cache).
Each head vector u (D,) at position t = start_pos + i is rotated pairwise, pair j < D/2 made of
u[j] and u[j + D/2], by the angle t * inv_freq[j], inv_freq[j] = theta^(-2j/D):
    y[j]       = u[j] cos - u[j + D/2] sin
    y[j + D/2] = u[j + D/2] cos + u[j] sin
Backward: a rotation is orthogonal, so dx is dy rotated by the negative angle (sin -> -sin).
"""

import numpy as np

from nanoeuler_core.registry import Impl, Op, Sample, Tol


def cos_sin(T, D, theta, start_pos):
    """cos and sin of the angles, each (T, D/2), in float64 on every backend (so they agree)."""
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


def forward(x, *, theta, start_pos=0):
    cos, sin = cos_sin(x.shape[1], x.shape[3], theta, start_pos)
    return rotate(x, cos, sin), ()


def backward(dy, saved, x, *, theta, start_pos=0):
    cos, sin = cos_sin(x.shape[1], x.shape[3], theta, start_pos)
    return (rotate(dy, cos, -sin),)


def sample_inputs(rng):
    # (B, T, H, D, theta, start_pos): one pair; several heads; a decode-style offset; the model's base.
    for b, t, h, d, theta, start_pos in ((1, 1, 1, 2, 10000.0, 0), (2, 5, 3, 6, 100.0, 0),
                                         (2, 3, 4, 10, 10000.0, 7), (1, 4, 2, 16, 10000.0, 123)):
        x = rng.standard_normal((b, t, h, d))
        yield Sample((x,), {"theta": theta, "start_pos": start_pos}, grad_inputs=(0,),
                     name=f"B{b}_T{t}_H{h}_D{d}_p{start_pos}")


OP = Op(
    name="rope",
    summary="Rotary position embedding (half-split) of query or key heads",
    reference=Impl(forward, backward),
    sample_inputs=sample_inputs,
    backends={"cpu": "nanoeuler_ops.cpu.rope", "cuda": "nanoeuler_ops.cuda.rope"},
    tol=Tol(rtol=1e-4, atol=1e-5),
    precisions={"cuda": ("bf16",)},
)
