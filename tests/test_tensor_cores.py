"""The tensor-core primitives of the CUDA backend: a warp's mma.sync tile in the documented fragment
layout, tiles copied to shared memory by cp.async and read into fragments by ldmatrix, a warpgroup's
wgmma products from swizzled shared memory (and the attention forward built on them), and bf16
conversions. On a GPU the inline-PTX instructions run; under the simulator their
twins, which the simulated tensor-core kernels rely on, are checked against the same NumPy answer."""

import os
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda, float32, uint32, uint64

from nanoeuler_core.registry import bf16_bits, bf16_values
from nanoeuler_ops.cuda import device, runtime


@cuda.jit
def _one_tile(a, b, c, d):
    # a (16, 8) words: A (16 x 16) bf16 pairs; b (8, 8) words: B (16 x 8) as B^T rows of pairs; c, d (16, 8)
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    out = device.mma_bf16(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[g, t], b[g, t + 4],
                           c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = out[0], out[1], out[2], out[3]


SHARED_ROW = 12   # words per shared row: 8 of data and 4 of padding, a multiple of 16 bytes
SHARED_WORDS = 16 * SHARED_ROW
SHARED_ALIGN = 16
# (globals: a shared array's size and alignment must reach the compiler as constants)


@cuda.jit
def _tile_through_shared(a, src, valid_rows, trans, d):
    # a (16, 8) words: A (16 x 16); src (128,) words, 16 rows of 8: B^T by rows (n-major), or B by
    # rows (k-major) if trans; d (16, 16) = A B, B's rows (trans) or columns past valid_rows as zeros
    sh = cuda.shared.array(SHARED_WORDS, uint32, alignment=SHARED_ALIGN)
    base = device.shared_base(sh)
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    row, chunk = lane // 2, 4 * (lane % 2)   # one 16-byte chunk a lane
    device.cp_async_16(sh, base, uint32(row * SHARED_ROW + chunk), src, uint64(min(row, valid_rows - 1) * 8 + chunk),
                        row < valid_rows)
    device.cp_async_wait_all()
    cuda.syncthreads()
    if trans:   # matrices: k rows 0-7 and 8-15 of n columns 0-7, then of n columns 8-15
        b = device.ldmatrix_x4_trans(sh, base, uint32((lane % 8 + 8 * (lane // 8 % 2)) * SHARED_ROW + 4 * (lane // 16)))
    else:       # matrices: n rows 0-7 over k 0-7 and k 8-15, then n rows 8-15
        b = device.ldmatrix_x4(sh, base, uint32((lane % 8 + 8 * (lane // 16)) * SHARED_ROW + 4 * (lane // 8 % 2)))
    for n in range(2):
        out = device.mma_bf16(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[2 * n], b[2 * n + 1],
                               np.float32(0), np.float32(0), np.float32(0), np.float32(0))
        d[g, 8 * n + 2 * t], d[g, 8 * n + 2 * t + 1] = out[0], out[1]
        d[g + 8, 8 * n + 2 * t], d[g + 8, 8 * n + 2 * t + 1] = out[2], out[3]


@cuda.jit
def _conversions(x, rounded, pairs, back):
    # x (n,) float32 -> rounded (n,) bf16 bits, pairs (n/2,) packed, back (n,) float32 from the pairs
    i = cuda.grid(1)
    if i < x.shape[0]:
        rounded[i] = device.stored(rounded, x[i])
    if i < pairs.shape[0]:
        pairs[i] = device.pack_bf16x2(x[2 * i], x[2 * i + 1])
        back[2 * i], back[2 * i + 1] = device.bf16x2_values(pairs[i])


WG_TILE = 64 * 32                 # words of a 64 x 64 bf16 tile
WG_WORDS = 256 + 3 * WG_TILE      # three tiles from the first 1024-byte aligned word


@cuda.jit
def _warpgroup_tiles(a, bt, v, d_ss, d_rs):
    # a, bt, v (64, 32) words: A (64 x 64) by rows, B^T by rows, V by rows; one warpgroup computes
    # d_ss = A B with both operands in shared memory and d_rs = A V with A in registers (64 x 64 each)
    sh = cuda.shared.array(WG_WORDS, uint32, alignment=SHARED_ALIGN)
    base = device.shared_base(sh)
    at = ((uint32(1024) - (base & uint32(1023))) & uint32(1023)) >> uint32(2)
    tid = cuda.threadIdx.x
    for i in range(tid, 3 * 64 * 8, 128):   # the tiles' 16-byte chunks, stored in the 128-byte swizzle
        tile, row, chunk = i // 512, i // 8 % 64, i % 8
        for w in range(4):
            word = a[row, 4 * chunk + w] if tile == 0 else (bt[row, 4 * chunk + w] if tile == 1 else v[row, 4 * chunk + w])
            sh[at + tile * WG_TILE + row * 32 + 4 * (chunk ^ (row % 8)) + w] = word
    device.proxy_fence()
    cuda.syncthreads()
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    r = 16 * warp + g
    acc = cuda.local.array((8, 4), float32)
    frag = cuda.local.array((4, 4), uint32)
    descs = (device.smem_descriptor(base + 4 * at, 1024), device.smem_descriptor(base + 4 * (at + WG_TILE), 1024),
             device.smem_descriptor(base + 4 * (at + 2 * WG_TILE), 1024))
    for product in range(2):
        if product == 0:
            device.wgmma_fence(acc, acc)
            for kc in range(4):   # 32 bytes along the rows of A and B^T a k-step
                device.wgmma_ss(acc, sh, descs[0] + uint64(2 * kc), descs[1] + uint64(2 * kc), kc > 0)
        else:
            for kc in range(4):
                frag[kc, 0], frag[kc, 1] = a[r, 8 * kc + t], a[r + 8, 8 * kc + t]
                frag[kc, 2], frag[kc, 3] = a[r, 8 * kc + t + 4], a[r + 8, 8 * kc + t + 4]
            device.wgmma_fence(acc, frag)
            for kc in range(4):   # 16 rows of V a k-step
                device.wgmma_rs_t(acc, frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3], sh,
                                   descs[2] + uint64(128 * kc), kc > 0)
        device.wgmma_commit()
        device.wgmma_wait(acc)
        d = d_ss if product == 0 else d_rs
        for j in range(8):
            d[r, 8 * j + 2 * t], d[r, 8 * j + 2 * t + 1] = acc[j, 0], acc[j, 1]
            d[r + 8, 8 * j + 2 * t], d[r + 8, 8 * j + 2 * t + 1] = acc[j, 2], acc[j, 3]


def _words(m):
    """(R, 2K) float -> (R, K) uint32 of bf16 pairs, the lower column in the low half."""
    bits = bf16_bits(m).astype(np.uint32)
    return bits[:, 0::2] | (bits[:, 1::2] << 16)


def test_mma_tile_matches_numpy():
    rng = np.random.default_rng(0)
    a = bf16_values(bf16_bits(rng.standard_normal((16, 16))))
    b = bf16_values(bf16_bits(rng.standard_normal((16, 8))))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = cuda.device_array((16, 8), np.float32)
    _one_tile[1, 32](cuda.to_device(_words(a)), cuda.to_device(_words(b.T)), cuda.to_device(c), d)
    expected = a.astype(np.float64) @ b + c
    np.testing.assert_allclose(d.copy_to_host(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans", [False, True])
def test_cp_async_and_ldmatrix_give_mma_fragments(trans):
    """A B tile copied to shared memory by cp.async (rows past the valid ones zero-filled) and read
    by ldmatrix, as stored (B^T by rows) or transposed (B by rows), multiplies as NumPy does."""
    rng = np.random.default_rng(2)
    a = bf16_values(bf16_bits(rng.standard_normal((16, 16))))
    b = bf16_values(bf16_bits(rng.standard_normal((16, 16))))
    valid_rows = 13
    stored = b if trans else b.T
    d = cuda.device_array((16, 16), np.float32)
    _tile_through_shared[1, 32](cuda.to_device(_words(a)), cuda.to_device(_words(stored).reshape(-1)), valid_rows,
                                trans, d)
    kept = b.copy()
    if trans:
        kept[valid_rows:, :] = 0.0
    else:
        kept[:, valid_rows:] = 0.0
    np.testing.assert_allclose(d.copy_to_host(), a.astype(np.float64) @ kept, rtol=1e-5, atol=1e-5)


def test_bf16_conversions_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(60), [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -0.0, 3.0e38]]).astype(np.float32)
    rounded = cuda.device_array(x.size, np.uint16)
    pairs = cuda.device_array(x.size // 2, np.uint32)
    back = cuda.device_array(x.size, np.float32)
    _conversions[1, 64](cuda.to_device(x), rounded, pairs, back)
    expected = bf16_bits(x)
    assert np.array_equal(rounded.copy_to_host(), expected)   # ties go to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6
    assert np.array_equal(back.copy_to_host(), bf16_values(expected))


warpgroup = pytest.mark.skipif(not (cuda.is_available() and runtime.warpgroup_mma()),
                               reason="warpgroup products need a Hopper GPU (or the simulator)")


@warpgroup
def test_warpgroup_products_match_numpy():
    """wgmma's two forms, A and B^T from swizzled shared memory, and A from registers times B stored
    by rows (transposed), multiply as NumPy does: on a GPU the instructions and the descriptors'
    layout, under the simulator the twins that decode them."""
    rng = np.random.default_rng(3)
    a, bt, v = (bf16_values(bf16_bits(rng.standard_normal((64, 64)))) for _ in range(3))
    d_ss, d_rs = cuda.device_array((64, 64), np.float32), cuda.device_array((64, 64), np.float32)
    _warpgroup_tiles[1, 128](*(cuda.to_device(_words(m)) for m in (a, bt, v)), d_ss, d_rs)
    np.testing.assert_allclose(d_ss.copy_to_host(), a.astype(np.float64) @ bt.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_rs.copy_to_host(), a.astype(np.float64) @ v, rtol=1e-5, atol=1e-4)


@warpgroup
def test_warpgroup_attention_forward_matches_the_reference():
    """The attention forward on warpgroup products (head size 64) against the float64 reference from
    the same bf16 inputs: two query tiles, the last partly filled, GQA, keys after a cache (S > T)."""
    from nanoeuler_ops import attention as reference
    from nanoeuler_ops.cuda import attention
    from nanoeuler_ops.cuda.attention import wgmma

    assert wgmma.wgmma_supported(64)
    rng = np.random.default_rng(4)
    q, k, v = (bf16_values(bf16_bits(x)) for x in (rng.standard_normal((1, 67, 2, 64)), rng.standard_normal((1, 70, 1, 64)),
                                                    rng.standard_normal((1, 70, 1, 64))))
    o, (_, lse) = attention.forward(*(cuda.to_device(bf16_bits(x).view(device.BF16)) for x in (q, k, v)))
    o_ref, (_, lse_ref) = reference.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(bf16_values(device.DEVICE.to_host(o).view(np.uint16)), o_ref, atol=1e-2)
    np.testing.assert_allclose(device.DEVICE.to_host(lse), lse_ref, rtol=1e-5, atol=1e-5)


HOPPER_COMPILE = """
import sys
from types import SimpleNamespace
from numba import types
from numba.cuda import compile_ptx
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    sys.exit(77)
# Numba types an overload's implementation (to_f32, load_8_floats, ...) by compiling it for the
# current GPU's compute capability: here there is none, so it is a Hopper's
import numba.cuda.dispatcher
numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
sys.path.insert(0, "tests")
import test_tensor_cores as t
from nanoeuler_ops.cuda import attention, device
words, words2, floats2 = types.Array(types.uint32, 1, "C"), types.Array(types.uint32, 2, "C"), types.Array(types.float32, 2, "C")
kernels = {"one_tile": (t._one_tile, (words2, words2, floats2, floats2)),
           "tile_through_shared": (t._tile_through_shared, (words2, words, types.int64, types.boolean, floats2))}
for head_size in (48, 64):   # a row of 6 copy chunks (no whole number of rows per pass), and 8
    family = attention.tensor_core_kernels(head_size, hopper=True)   # head size 64: the warpgroup forward
    for name, argtypes in attention.mma.mma_signatures().items():
        kernels[f"attention {name} D{head_size}"] = (getattr(family, name).function, argtypes)
kernels["warpgroup tiles"] = (t._warpgroup_tiles, (words2,) * 3 + (floats2,) * 2)
for name, (kernel, argtypes) in kernels.items():
    ptx, _ = compile_ptx(kernel.py_func, argtypes, cc=(9, 0, "a"), fastmath=kernel.targetoptions.get("fastmath", False))
    assert ("wgmma.mma_async" in ptx) == (name in ("attention forward D64", "warpgroup tiles")), name
    print("compiled", name)
# the decoding kernels as for a GPU that overlaps kernels: each must wait for the kernel ahead of it
from nanoeuler_ops.cuda import decode_attention, linear_residual, row_products
device.DEVICE._overlaps = True
flat, ints, i64 = types.Array(types.float32, 1, "C"), types.Array(types.int64, 1, "C"), types.int64
rows, bf16_rows, f32 = types.Array(types.float32, 2, "C"), types.Array(types.uint16, 2, "C"), types.float32
attend, combine = decode_attention._kernels(64)
decoding = {"attend": (attend, (flat,) * 3 + (i64,) * 5 + (ints,) + (flat,) * 5, None),
            "combine": (combine, (flat,) * 3 + (ints,) + (i64,) * 4 + (flat,), None)}
# the matrix products on the tensor cores: norm_tiles as norm_swiglu's, two matrices (norm_linear's
# is its first half), and linear_residual's, both reading their operands by 16-byte loads, a slice's
# four groups of rows at once with every group's sums in registers (no local memory)
groups = types.UniTuple(types.int32, 4)
decoding["norm_tiles"] = (row_products.norm_tiles, (rows, rows, bf16_rows, i64, f32, types.UniTuple(types.int32, 2),
                                                    groups, rows), "mma.sync")
decoding["linear_residual mma"] = (linear_residual._forward_mma, (rows, bf16_rows, rows, groups, rows), "mma.sync")
for name, (kernel, argtypes, instruction) in decoding.items():
    ptx, _ = compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, name
    assert instruction is None or (instruction in ptx and "ld.global.nc.v4" in ptx and "ld.local" not in ptx
                                   and "st.local" not in ptx), name
    print("compiled decoding", name)
"""


def test_tensor_core_kernels_compile_for_hopper():
    """The simulator runs a kernel as Python, so it accepts some that the compiler refuses (a shared
    array sized by an expression), and it never runs the instructions that let kernels overlap.
    This compiles the tensor-core kernels, the attention family for two head sizes (64 with the
    warpgroup forward) and this file's, and the decoding kernels (attention, and the matrix
    products on the tensor cores) with their overlap instructions, to sm_90a PTX (as Numba builds
    for Hopper) through NVVM, in a process without the simulator: no GPU needed."""
    assert compiled_without_simulator(HOPPER_COMPILE).count("compiled") == 2 + 2 * 3 + 1 + 2 + 2


def compiled_without_simulator(script: str) -> str:
    """The output of `script`, run in a process without the simulator from the repository root; the
    test is skipped where the script exits 77 (no CUDA toolkit) and fails where it fails."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    result = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)),
                            env=env, capture_output=True, text=True, timeout=600)
    if result.returncode == 77:
        pytest.skip("no CUDA toolkit (NVVM) on this machine")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
