"""Weight-only quantized matrices: the formats decoding can read instead of float weights
(docs/decoding.md, "Quantized weights").

A matrix w (O, K) is cut, row by row, into groups of `group` consecutive weights; each group has a
float16 scale, and in 4 bits a float16 offset too:

    int8   q int8  (O, K)        w[o, k] = scale[o, k // group] * q[o, k]                  q in -127..127
    int4   q uint8 (O, K // 2)   w[o, k] = scale[o, k // group] * nibble[o, k] + zero[o, k // group]
                                                                                          nibble in 0..15

The 4-bit nibbles are packed by blocks of QBLOCK = 32 weights, as GGUF's Q4_0 and Q4_1 pack them:
byte j (0..15) of a block holds weight j of the block in its low nibble and weight j + 16 in its
high one. A kernel then unpacks 16 consecutive weights from each half of 16 bytes. With groups of
32, int8 is GGUF's Q8_0 (34 bytes a block) and int4 its Q4_1 (20 bytes), the same bytes and the same
float16 scales and offsets, so GGUF's Q8_0, Q4_0 and Q4_1 tensors load bit for bit (Q4_0 is the
offset -8 * scale, exact in float16).

A quantized matrix is three arrays (q, scale, zero); int8 has no offset and its `zero` is an
(O, 0) array. The shapes and q's dtype tell the format (`weight_format`), so a kernel that takes `*w`
reads either one float matrix (w,) or a quantized one (q, scale, zero).

A product with a quantized matrix reads its activations rounded to 8 bits too, as GGUF's Q8_0
rounds them: each block of QBLOCK consecutive values of a row (the last block of a row may be
shorter) becomes d * round(x / d), d = max |x| / 127 over the block (`round_activations`). Both
factors are then small integers, so a kernel multiplies them as integers (8-bit SIMD on the CPU,
dp4a on the GPU) and scales each block's sum once; float weights read float activations.
"""

from __future__ import annotations

import numpy as np

QBLOCK = 32                  # weights per packed 4-bit block; 4-bit groups are whole blocks
SCALES = np.float16          # the dtype of scales and offsets
FORMATS = ("int8", "int4")
DEFAULT_GROUP = {"int8": 0, "int4": 32}   # 0: one group per row (a scale per output channel)


def check_group(fmt: str, K: int, group: int) -> int:
    """The group size `fmt` uses for rows of K weights (group 0: the whole row); ValueError, one
    line, where it does not fit."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (choose from: {', '.join(FORMATS)})")
    group = group or K
    if group < 1 or K % group:
        raise ValueError(f"{fmt}: a group of {group} weights does not divide rows of {K}")
    if fmt == "int4" and group % QBLOCK:
        raise ValueError(f"int4: groups are whole blocks of {QBLOCK} weights, got {group}")
    return group


def quantize(w: np.ndarray, fmt: str, group: int = 0, zero_point: bool = True):
    """w (O, K) float -> (q, scale, zero) in `fmt` ("int8" or "int4") with groups of `group`
    weights (0: a group per row). int8 is symmetric: scale = max |w| / 127. int4 with a zero point
    (GGUF's Q4_1) maps each group's [min, max] onto 0..15; without one (Q4_0) the group's weight
    of largest magnitude maps to -8 * scale, and zero = -8 * scale. The integers are rounded with
    the scales and offsets as float16 rounds them; ValueError, one line, for weights whose scale
    float16 cannot hold (above 65504)."""
    w = np.asarray(w, dtype=np.float64)
    O, K = w.shape
    group = check_group(fmt, K, group)
    groups = w.reshape(O, K // group, group)
    if fmt == "int8":
        scale = _half(np.abs(groups).max(axis=2) / 127.0)
        inverse = _inverse(scale)
        q = np.clip(np.rint(groups * inverse[..., None]), -127, 127).astype(np.int8).reshape(O, K)
        return q, scale, np.zeros((O, 0), SCALES)
    if zero_point:
        low, high = groups.min(axis=2), groups.max(axis=2)
        scale, zero = _half((high - low) / 15.0), _half(low)
    else:
        extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=2)[..., None], axis=2)[..., 0]
        scale = _half(extreme / -8.0)
        zero = _half(-8.0 * scale.astype(np.float64))   # exact where it fits
    inverse = _inverse(scale)
    nibbles = np.clip(np.rint((groups - zero[..., None]) * inverse[..., None]), 0, 15).astype(np.uint8)
    return pack4(nibbles.reshape(O, K)), scale, zero


def _inverse(scale: np.ndarray) -> np.ndarray:
    """1 / scale in float64 (0 where scale is 0)."""
    return np.divide(1.0, scale.astype(np.float64), out=np.zeros(scale.shape), where=scale != 0)


def _half(values: np.ndarray) -> np.ndarray:
    """Scales or offsets as float16; ValueError, one line, where one overflows it."""
    with np.errstate(over="ignore"):
        half = np.asarray(values).astype(SCALES)
    if np.isinf(half).any() > np.isinf(values).any():
        raise ValueError(f"weights too large for float16 scales: a scale or offset of "
                         f"{np.abs(np.asarray(values, np.float64)).max():.4g} (float16 holds at most 65504)")
    return half


def half_scales(q, scale, zero) -> tuple:
    """(q, scale, zero) with its scales and offsets as float16 (float32 ones, as older runs store
    them, rounded to the nearest: exact for those that came from float16, as GGUF's did); ValueError,
    one line, where one overflows it."""
    return q, _half(scale), _half(zero)


def pack4(nibbles: np.ndarray) -> np.ndarray:
    """Nibbles (O, K) in 0..15, K a multiple of QBLOCK -> bytes (O, K // 2) in blocks of 32 (see above)."""
    O, K = nibbles.shape
    blocks = nibbles.reshape(O, K // QBLOCK, 2, QBLOCK // 2).astype(np.uint8)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(O, K // 2)


def unpack4(q: np.ndarray) -> np.ndarray:
    """Bytes (O, K // 2) packed by `pack4` -> nibbles (O, K)."""
    O, half = q.shape
    blocks = q.reshape(O, half // (QBLOCK // 2), 1, QBLOCK // 2)
    return np.concatenate((blocks & 15, blocks >> 4), axis=2).reshape(O, 2 * half)


def weight_format(q, scale, zero) -> tuple[str, int, int]:
    """(format, group, K) of the quantized matrix (q, scale, zero), told by their dtypes and shapes;
    ValueError, one line, for arrays that are not one."""
    O = q.shape[0]
    if q.ndim == 2 and scale.ndim == 2 and zero.ndim == 2 and scale.shape[0] == O == zero.shape[0] and scale.shape[1]:
        fmt = {np.int8: "int8", np.uint8: "int4"}.get(q.dtype.type)   # (not str(dtype): slow, every product)
        K = q.shape[1] * (2 if fmt == "int4" else 1)
        groups = scale.shape[1]
        if fmt and K % groups == 0 and zero.shape[1] == (groups if fmt == "int4" else 0):
            group = K // groups
            if fmt == "int8" or group % QBLOCK == 0:
                return fmt, group, K
    raise ValueError(f"not a quantized matrix: q {q.dtype} {q.shape}, scale {scale.dtype} {scale.shape}, "
                     f"zero {zero.dtype} {zero.shape}")


def dequantize(q, scale, zero) -> np.ndarray:
    """The float64 matrix (O, K) a quantized one stands for."""
    fmt, group, K = weight_format(q, scale, zero)
    O = q.shape[0]
    values = (unpack4(q) if fmt == "int4" else q).astype(np.float64).reshape(O, K // group, group)
    values = values * np.asarray(scale, np.float64)[..., None]
    if fmt == "int4":
        values = values + np.asarray(zero, np.float64)[..., None]
    return values.reshape(O, K)


def round_activations(x: np.ndarray) -> np.ndarray:
    """x (N, K) -> the float64 values a quantized product reads: each block of QBLOCK values along
    K (the last one of a row may be shorter) as d * rint(x * (127 / max |x|)), d = max |x| / 127
    (a block of zeros stays zero). The rounding is computed in float32, as the kernels compute it."""
    x = np.asarray(x, dtype=np.float32)
    N, K = x.shape
    out = np.zeros((N, K))
    for k in range(0, K, QBLOCK):
        block = x[:, k:k + QBLOCK]
        amax = np.abs(block).max(axis=1, keepdims=True)
        inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
        out[:, k:k + QBLOCK] = np.rint(block * inverse) * (amax.astype(np.float64) / 127.0)
    return out


def product(x: np.ndarray, *w) -> np.ndarray:
    """x (N, K) @ w.T in float64, as the decoding ops define it: a float matrix (w,) multiplies x
    itself, a quantized one (q, scale, zero) multiplies x rounded to 8 bits (`round_activations`)."""
    if len(w) == 1:
        return x @ w[0].T
    return round_activations(x) @ dequantize(*w).T


def shape(*w) -> tuple[int, int]:
    """(O, K) of a weight argument: (w,) or (q, scale, zero); ValueError for neither."""
    if len(w) == 1:
        return tuple(w[0].shape) if w[0].ndim == 2 else (-1, -1)
    if len(w) == 3:
        return w[0].shape[0], weight_format(*w)[2]
    raise ValueError(f"a weight is one float matrix or (q, scale, zero), got {len(w)} arrays")


def concatenate(parts) -> tuple:
    """Quantized matrices of one format and group, stacked by rows (the decoder's wqkv and heads)."""
    formats = {weight_format(*p)[:2] for p in parts}
    if len(formats) != 1:
        raise ValueError(f"cannot stack quantized matrices of different formats: {sorted(formats)}")
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def nbytes(q, scale, zero) -> int:
    return q.nbytes + scale.nbytes + zero.nbytes


# the bound the ops' quantized samples are checked with: a value the float32 kernels round to 8 bits
# the other way than the float64 reference moves an output by d * |w| (d = max |x| / 127 of its block)
SAMPLE_TOL = (1e-3, 2e-2)

# formats the ops' samples check: (format, group, zero point)
SAMPLE_FORMATS = (("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 64, False))


def sample_matrices(rng: np.random.Generator, O: int, K: int, scale: float = 1.0):
    """(label, (q, scale, zero)) for each of SAMPLE_FORMATS: random (O, K) matrices of standard
    deviation scale / sqrt(K), quantized (the ops' test cases; K a multiple of 64)."""
    for fmt, group, zero_point in SAMPLE_FORMATS:
        w = scale * rng.standard_normal((O, K)) / K ** 0.5
        yield f"{fmt}g{group or K}{'' if zero_point else 's'}", quantize(w, fmt, group, zero_point)
