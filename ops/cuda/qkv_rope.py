"""Split a fused q/k/v projection into heads and rotate q and k, on the GPU, float32 or bf16
storage (float32 arithmetic): one pass each way. See nanoeuler_ops/qkv_rope.py for the math."""

from numba import cuda

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.rope import _table
from nanoeuler_ops.cuda.runtime import stored, to_f32
from nanoeuler_ops.qkv_rope import check_shape

THREADS = 256


@cuda.jit(cache=True)
def _split(qkv, cos, sin, start_pos, q, k, v):
    # qkv (B, T, (H + 2 KV) D), cos/sin (L, D/2) -> q (B, T, H, D), k, v (B, T, KV, D);
    # one thread per pair (b, t, head, j), j < D/2: q and k heads rotated, v heads copied
    i = cuda.grid(1)
    B, T, H, D = q.shape
    KV = k.shape[2]
    half = D // 2
    heads = H + 2 * KV
    if i < B * T * heads * half:
        j = i % half
        head = (i // half) % heads
        bt = i // (half * heads)
        b, t = bt // T, bt % T
        u1 = to_f32(qkv[b, t, head * D + j])
        u2 = to_f32(qkv[b, t, head * D + j + half])
        if head < H + KV:
            c = cos[start_pos + t, j]
            s = sin[start_pos + t, j]
            u1, u2 = u1 * c - u2 * s, u2 * c + u1 * s
        if head < H:
            q[b, t, head, j] = stored(q, u1)
            q[b, t, head, j + half] = stored(q, u2)
        elif head < H + KV:
            k[b, t, head - H, j] = stored(k, u1)
            k[b, t, head - H, j + half] = stored(k, u2)
        else:
            v[b, t, head - H - KV, j] = stored(v, u1)
            v[b, t, head - H - KV, j + half] = stored(v, u2)


@cuda.jit(cache=True)
def _gather(dq, dk, dv, cos, sin, start_pos, dqkv):
    # dq (B, T, H, D), dk, dv (B, T, KV, D) -> dqkv (B, T, (H + 2 KV) D): dq and dk rotated back
    i = cuda.grid(1)
    B, T, H, D = dq.shape
    KV = dk.shape[2]
    half = D // 2
    heads = H + 2 * KV
    if i < B * T * heads * half:
        j = i % half
        head = (i // half) % heads
        bt = i // (half * heads)
        b, t = bt // T, bt % T
        if head < H:
            u1, u2 = to_f32(dq[b, t, head, j]), to_f32(dq[b, t, head, j + half])
        elif head < H + KV:
            u1, u2 = to_f32(dk[b, t, head - H, j]), to_f32(dk[b, t, head - H, j + half])
        else:
            u1, u2 = to_f32(dv[b, t, head - H - KV, j]), to_f32(dv[b, t, head - H - KV, j + half])
        if head < H + KV:
            c = cos[start_pos + t, j]
            s = -sin[start_pos + t, j]
            u1, u2 = u1 * c - u2 * s, u2 * c + u1 * s
        dqkv[b, t, head * D + j] = stored(dqkv, u1)
        dqkv[b, t, head * D + j + half] = stored(dqkv, u2)


def forward(qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    check_shape(qkv, n_heads, n_kv_heads)
    B, T, width = qkv.shape
    D = width // (n_heads + 2 * n_kv_heads)
    cos, sin = _table(start_pos + T, D, theta)
    q = runtime.empty((B, T, n_heads, D), qkv.dtype)
    k = runtime.empty((B, T, n_kv_heads, D), qkv.dtype)
    v = runtime.empty((B, T, n_kv_heads, D), qkv.dtype)
    runtime.launch(_split, runtime.blocks_for(qkv.size // 2, THREADS), THREADS, qkv, cos, sin, start_pos, q, k, v)
    return (q, k, v), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    dq, dk, dv = dout
    cos, sin = _table(start_pos + qkv.shape[1], dq.shape[3], theta)
    dqkv = runtime.empty(qkv.shape, qkv.dtype)
    runtime.launch(_gather, runtime.blocks_for(qkv.size // 2, THREADS), THREADS, dq, dk, dv, cos, sin, start_pos, dqkv)
    return (dqkv,)
