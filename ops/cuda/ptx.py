"""The device library's instructions on a GPU: inline PTX and warp shuffles.

Every name in __all__ has a twin of the same name and behaviour in ops/cuda/simulator.py, for
Numba's CUDA simulator, and ops/cuda/device.py takes the one set or the other: kernels import these
from there. All of the CUDA layer's inline PTX is in this file, each instruction under a comment
giving its semantics (for the tensor cores, the fragment layout). docs/cuda.md tells the whole story.
"""

import math

from llvmlite import ir
from numba import cuda, float32, float64, types, uint16, uint32, uint64
from numba.cuda.extending import intrinsic, overload

from nanoeuler_ops.cuda.gpu import DEVICE

__all__ = ["WARP", "to_f32", "stored", "pack_bf16x2", "bf16x2_values", "pair_values", "stored_pair",
           "wait_for_previous", "let_next_start", "prefetch_l2", "load_16_bytes", "load_8_floats",
           "dp4a", "rint_scaled", "warp_sum", "warp_max", "warp_ballot", "quad_sum", "quad_max", "lanes_reduce",
           "block_reduce", "mma_bf16",
           "shared_base", "cp_async_16", "cp_async_wait_all", "ldmatrix_x4", "ldmatrix_x4_trans",
           "wgmma_ss", "wgmma_rs_t", "wgmma_fence", "wgmma_commit", "wgmma_wait", "proxy_fence"]

WARP = 32
FULL_MASK = 0xFFFFFFFF   # every lane of the warp takes part in a shuffle


def _data(context, builder, array_type, array):
    # the pointer to an array argument's first element
    return context.make_array(array_type)(context, builder, array).data


# ---------------------------------------------------------------- bfloat16 storage
# A bf16 array is stored as its 16-bit patterns (uint16; ops/cuda/device.py's BF16): `to_f32(x[i])`
# reads a stored value as float32 and `y[i] = stored(y, v)` rounds a float32 to y's storage (round
# to nearest even for bf16), each an overload that compiles to the storage's own instructions.

@intrinsic
def float_from_bits(typingctx, bits):
    # uint32 bit pattern -> float32 with those bits
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def pack_bf16x2(typingctx, lo, hi):
    """Two float32 -> one uint32 holding their bf16 patterns, lo in the low half (one cvt)."""
    def codegen(context, builder, sig, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return builder.call(asm, [args[1], args[0]])   # cvt puts its first source in the high half
    return types.uint32(types.float32, types.float32), codegen


@cuda.jit(device=True, inline=True)
def _bf16_to_f32(x):
    return float_from_bits(uint32(x) << uint32(16))


@cuda.jit(device=True, inline=True)
def _f32_to_bf16(v):
    return uint16(pack_bf16x2(v, float32(0.0)) & uint32(0xFFFF))


@cuda.jit(device=True, inline=True)
def bf16x2_values(pair):
    """One uint32 of two bf16 patterns -> (low, high) as float32."""
    return float_from_bits(pair << uint32(16)), float_from_bits(pair & uint32(0xFFFF0000))


def to_f32(x):
    """A stored value (float32, float16, or bf16 bits) as float32."""


def stored(like, v):
    """The float32 v rounded to the storage of the array `like`."""


@overload(to_f32, inline="always")
def _to_f32(x):
    if x == types.uint16:
        return lambda x: _bf16_to_f32(x)
    return lambda x: float32(x)


@overload(stored, inline="always")
def _stored(like, v):
    if like.dtype == types.uint16:
        return lambda like, v: _f32_to_bf16(float32(v))
    return lambda like, v: float32(v)


# ---------------------------------------------------------------- element pairs
# A word of `pairs(arr)` (ops/cuda/device.py) holds two neighbouring elements, the first in the low
# half: uint32 for two bf16 patterns, uint64 for two float32.

@intrinsic
def _bits_from_float(typingctx, value):
    # float32 -> uint32 with the same bits
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def pair_values(word):
    """A word of `pairs` -> its (first, second) element as float32."""


def stored_pair(like, lo, hi):
    """Two float32 -> the word of `pairs` array `like` holding them in its storage."""


@overload(pair_values, inline="always")
def _pair_values(word):
    if word == types.uint32:
        return lambda word: bf16x2_values(word)
    return lambda word: (float_from_bits(uint32(word & uint64(0xFFFFFFFF))),
                         float_from_bits(uint32(word >> uint64(32))))


@overload(stored_pair, inline="always")
def _stored_pair(like, lo, hi):
    if like.dtype == types.uint32:
        return lambda like, lo, hi: pack_bf16x2(float32(lo), float32(hi))
    return lambda like, lo, hi: (uint64(_bits_from_float(float32(lo)))
                                 | (uint64(_bits_from_float(float32(hi))) << uint64(32)))


# ---------------------------------------------------------------- overlapping kernels
# Programmatic dependent launch (compute capability 9.0 and later). A kernel launched with
# `launch(..., overlap=True)` may be scheduled while the kernel ahead of it on the stream still
# runs, once every block of that one has called let_next_start() (or ended). It may read what no
# kernel in flight writes (the weights) at once; wait_for_previous() then blocks until the kernels
# ahead of it have ended and their writes are visible, and only after it may it read their outputs
# or write anything. A decoding step is a chain of small kernels each waiting on the last: each
# asks for its weights to come into L2 (prefetch_l2, which holds no registers) before it waits, so
# they come while the kernel ahead of it runs. Where kernels do not overlap (GPUs before 9.0) both
# calls compile to nothing.

@intrinsic
def prefetch_l2(typingctx, arr, i):
    """Ask for the 128-byte line holding element i of the contiguous array arr (counted from its
    first element) to be brought into L2, holding no register while it comes."""
    sig = types.void(arr, types.int64)

    def codegen(context, builder, sig, args):
        address = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]),
                                   ir.IntType(64))
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                           "{ .reg .u64 g; cvta.to.global.u64 g, $0; prefetch.global.L2 [g]; }", "l",
                           side_effect=True)
        builder.call(asm, [address])
        return context.get_dummy_value()
    return sig, codegen


def _grid_dependency_control(instruction):
    @intrinsic
    def control(typingctx):
        def codegen(context, builder, sig, args):
            if DEVICE.overlaps():
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), instruction, "~{memory}", side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()
        return types.void(), codegen
    return control


wait_for_previous = _grid_dependency_control("griddepcontrol.wait;")
let_next_start = _grid_dependency_control("griddepcontrol.launch_dependents;")


# ---------------------------------------------------------------- 16-byte loads
# One instruction brings 16 bytes into four registers; decoding's matrix products read their
# operands this way, several loads in flight before the first is used.

@intrinsic
def load_16_bytes(typingctx, arr, i):
    """The 16 bytes from element i of the contiguous array arr on (its data 16-byte aligned
    there) as four uint32, in one load through the read-only path: only for what no kernel
    in flight writes."""
    sig = types.UniTuple(types.uint32, 4)(arr, types.int64)

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        address = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]), i64)
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64]),
                           "{ .reg .u64 g; cvta.to.global.u64 g, $4; ld.global.nc.v4.b32 {$0,$1,$2,$3}, [g]; }",
                           "=r,=r,=r,=r,l,~{memory}", side_effect=True)
        words = builder.call(asm, [address])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(words, k) for k in range(4)])
    return sig, codegen


def load_8_floats(a, row, c):
    """a[row, c:c+8] of a C-contiguous float32 or bf16 matrix as eight float32, by 16-byte loads
    through the read-only path (c a multiple of 8, the row's data 16-byte aligned there)."""


@overload(load_8_floats, inline="always")
def _load_8_floats(a, row, c):
    if a.dtype == types.uint16:
        def bf16_chunk(a, row, c):
            w0, w1, w2, w3 = load_16_bytes(a, row * a.shape[1] + c)
            e0, e1 = bf16x2_values(w0)
            e2, e3 = bf16x2_values(w1)
            e4, e5 = bf16x2_values(w2)
            e6, e7 = bf16x2_values(w3)
            return e0, e1, e2, e3, e4, e5, e6, e7
        return bf16_chunk

    def f32_chunk(a, row, c):
        i = row * a.shape[1] + c
        w0, w1, w2, w3 = load_16_bytes(a, i)
        w4, w5, w6, w7 = load_16_bytes(a, i + 4)
        return (float_from_bits(w0), float_from_bits(w1), float_from_bits(w2), float_from_bits(w3),
                float_from_bits(w4), float_from_bits(w5), float_from_bits(w6), float_from_bits(w7))
    return f32_chunk


# ---------------------------------------------------------------- 8-bit integer products
# A quantized product (ops/cuda/row_products.py) rounds its activations to int8 and multiplies them
# with int8 (or int4) weights as integers: four byte products and their sum in one instruction.

@intrinsic
def dp4a(typingctx, a, b, c):
    """c + the sum of the products of the four bytes of a with those of b, each byte a signed int8
    (int32 arithmetic: dp4a.s32.s32)."""
    sig = types.int32(types.uint32, types.uint32, types.int32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, args)
    return sig, codegen


_ROUNDER = 0x4B400000   # the bits of 1.5 * 2^23: a float32 n + 1.5 * 2^23 holds the integer n in its low bits


@intrinsic
def rint_scaled(typingctx, v, s):
    """The integer nearest the float32 product v * s (|v * s| < 2^22), half to even, as int32: the
    product rounded to float32 once (mul.rn, which the compiler never fuses into an add), then to
    an integer by adding 1.5 * 2^23 in float32, which leaves it in the sum's low bits."""
    sig = types.int32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]),
                           "{ .reg .f32 t; mul.rn.f32 t, $1, $2; add.rn.f32 t, t, 0f4B400000; mov.b32 $0, t; }",
                           "=r,f,f")
        return builder.sub(builder.call(asm, args), ir.Constant(i32, _ROUNDER))
    return sig, codegen


# ---------------------------------------------------------------- reductions
# Every lane of the warp must call these: the lanes exchange values by xor shuffles.

@cuda.jit(device=True, inline=True)
def warp_sum(x):
    """Sum of x over the 32 lanes of the warp, returned to every lane."""
    offset = WARP // 2
    while offset > 0:
        x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
        offset //= 2
    return x


@cuda.jit(device=True, inline=True)
def warp_max(x):
    """Max of x over the 32 lanes of the warp, returned to every lane."""
    offset = WARP // 2
    while offset > 0:
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
        offset //= 2
    return x


@cuda.jit(device=True, inline=True)
def warp_ballot(predicate):
    """A mask with bit `lane` set where that lane's predicate holds, returned to every lane."""
    return cuda.ballot_sync(FULL_MASK, predicate)


@cuda.jit(device=True, inline=True)
def quad_sum(x):
    """Sum of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)


@cuda.jit(device=True, inline=True)
def quad_max(x):
    """Max of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


@cuda.jit(device=True, inline=True)
def lanes_reduce(values, width, take_max):
    """values[i] <- its max (or sum) over this lane's group of `width` neighbouring lanes (a power
    of two, at most WARP), for every i of the local array `values`; the values' shuffles interleave."""
    offset = width // 2
    while offset > 0:
        for i in range(values.shape[0]):
            other = cuda.shfl_xor_sync(FULL_MASK, values[i], offset)
            values[i] = max(values[i], other) if take_max else values[i] + other
        offset //= 2


# The caller owns block_reduce's shared memory: a shared array declared inside a device function
# that a kernel reaches through two paths is defined twice when the kernel links (NVVM: "symbol
# multiply defined"), so each kernel declares `scratch = cuda.shared.array(32, float64)` once and
# passes it down. Every thread of the block must call it.

@cuda.jit(device=True)
def block_reduce(x, take_max, scratch):
    """Sum (or max, with take_max) of x over the whole (1-D) block in float64, returned to every
    thread: each warp reduces its lanes, then the warps' results (in scratch, a shared float64
    array of 32) are reduced by the same fixed tree, so the result depends only on the values and
    where they sit in the block."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    x = warp_max(float64(x)) if take_max else warp_sum(float64(x))
    if lane == 0:
        scratch[warp] = x
    cuda.syncthreads()
    if lane < (cuda.blockDim.x + WARP - 1) // WARP:
        x = scratch[lane]
    else:
        x = float64(-math.inf) if take_max else float64(0.0)
    x = warp_max(x) if take_max else warp_sum(x)
    cuda.syncthreads()   # scratch may be reused by the next call
    return x


# ---------------------------------------------------------------- tensor cores
# mma.sync.m16n8k16: one warp computes D = A B + C for A (16 x 16) and B (16 x 8) in bf16 and C, D
# (16 x 8) in float32. Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t,
# each register of A and B holding two bf16 (the lower index in the low half):
#   A: a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
#   B: b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
#   C, D: c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]
# Lanes 4g .. 4g+3 hold one row pair of C: quad_max and quad_sum reduce over them (xor shuffles by
# 1 and 2).

@intrinsic
def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C on the tensor cores (layout above); returns (d0, d1, d2, d3)."""
    sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4),
                           "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                           "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        result = builder.call(asm, args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])
    return sig, codegen


# ---------------------------------------------------------------- shared-memory tiles
# Tiles move from global to shared memory by cp.async (16 bytes a thread, no registers on the way)
# and from shared memory to mma fragments by ldmatrix. Both address word i (a uint32 index) of the
# shared uint32 array `sh`, given also `base = shared_base(sh)`: the GPU computes the address as
# base + 4 i in 32 bits, so a constant offset in i folds into the instruction.
#   cp_async_16(sh, base, i, src, j, valid): sh[i:i+4] <- src[j:j+4] (zeros where not valid), in
#       flight until cp_async_wait_all(); i and j multiples of 4 words (16-byte aligned).
#   ldmatrix_x4(sh, base, i): four 8 x 8 bf16 matrices; lanes 8m .. 8m+7 give, as i, the first words
#       of matrix m's rows 0..7 (four words each, 16-byte aligned). Returns register m = matrix m's
#       word t of row g (lane = 4g + t): the B fragment layout of mma_bf16 for a matrix stored
#       n-major (rows = n, words = k pairs).
#   ldmatrix_x4_trans(sh, base, i): the same matrices transposed: register m = the bf16 of matrix m's
#       rows 2t and 2t+1 at column g (low half: row 2t): the B fragment of a matrix stored k-major.

def _shared_word(builder, base, i):
    # the 32-bit shared address of word i: base + 4 i
    return builder.add(base, builder.shl(i, ir.Constant(ir.IntType(32), 2)))


@intrinsic
def shared_base(typingctx, sh):
    """The 32-bit shared-window address of sh[0]."""
    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
        return builder.ptrtoint(shared, ir.IntType(32))
    return types.uint32(sh), codegen


@intrinsic
def cp_async_16(typingctx, sh, base, i, src, j, valid):
    sig = types.void(sh, types.uint32, types.uint32, src, types.uint64, types.boolean)

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        dst = _shared_word(builder, args[1], args[2])
        source = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[3], args[3]), [args[4]]), i64)
        size = builder.select(args[5], i32(16), i32(0))   # a source size of 0 fills zeros
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32]),
                           "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.cg.shared.global [$0], [g], 16, $2; }",
                           "r,l,r,~{memory}", side_effect=True)
        builder.call(asm, [dst, source, size])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def cp_async_wait_all(typingctx):
    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}",
                           side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()
    return types.void(), codegen


def _ldmatrix(trans):
    @intrinsic
    def load(typingctx, sh, base, i):
        sig = types.UniTuple(types.uint32, 4)(sh, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                               f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16"
                               " {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            result = builder.call(asm, [_shared_word(builder, args[1], args[2])])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, m) for m in range(4)])
        return sig, codegen
    return load


ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4_trans = _ldmatrix(True)


# ---------------------------------------------------------------- warpgroup tensor cores (Hopper)
# wgmma.mma_async m64n64k16 (sm_90a): the block's four warps (a warpgroup) compute D (64 x 64, float32)
# = A (64 x 16) B (16 x 64) + D in bf16, B and optionally A read by the tensor cores from shared memory.
#   wgmma_ss(acc, sh, desc_a, desc_b, accumulate): A and B both from shared memory, each stored with
#       its k contiguous (A row by row, B column by column: a tile of keys row by row is B for Q K^T).
#   wgmma_rs_t(acc, a0, a1, a2, a3, sh, desc_b, accumulate): A from registers, as mma_bf16's A
#       fragments of the warp's 16 rows; B from shared memory with its n contiguous (a tile of values
#       row by row is B for P V).
# acc is a (8, 4) float32 register tile of the warp's 16 rows in mma_bf16's C layout, n-tile by
# n-tile: acc[j] = mma_bf16's c0..c3 for columns 8j .. 8j+7; without `accumulate` the old acc is
# ignored. Warp w of the group owns rows 16w .. 16w+15. A descriptor (device.smem_descriptor) names a tile
# in the 128-byte swizzle: rows of 128 bytes (64 bf16) in groups of 8 rows (1024 bytes, the group
# 1024-byte aligned), the 16-byte chunk c of row r stored at chunk c ^ (r % 8). Adding 2 to a
# descriptor moves it 32 bytes (the next k-step within a row), 64 moves it 8 rows.
# The products run asynchronously: wgmma_fence(acc, frag) before the first product that touches
# registers written since (the accumulators, and frag, the registers given as A: acc where none are),
# wgmma_commit() after a batch, and wgmma_wait(acc) before the accumulators are read; the fence and
# the wait pass their arrays through, so the compiler cannot move reads and writes across them.
# Shared memory written by cp.async must be made visible to the tensor cores by proxy_fence() in the
# writing threads before the barrier.


def _tied(builder, text, operand_types, operand_constraints, operands, arrays):
    # inline PTX `text` over the elements of `arrays` ((pointer, count, type, constraint letter)
    # each), read before and stored back after: its operands are the elements' outputs ($0 on),
    # then `operands`, then the elements' inputs, each tied to its output
    tied_types, letters, pointers = [], [], []
    for pointer, count, kind, letter in arrays:
        for i in range(count):
            pointers.append(builder.gep(pointer, [ir.Constant(ir.IntType(32), i)]))
            tied_types.append(kind)
            letters.append(letter)
    constraints = ",".join([f"={c}" for c in letters] + operand_constraints + [str(i) for i in range(len(letters))])
    asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType(tied_types), operand_types + tied_types),
                       text, constraints + ",~{memory}", side_effect=True)
    result = builder.call(asm, operands + [builder.load(pointer) for pointer in pointers])
    for i, pointer in enumerate(pointers):
        builder.store(builder.extract_value(result, i), pointer)


_ACC = 32   # accumulator registers a thread holds
_D = "{" + ",".join(f"${i}" for i in range(_ACC)) + "}"
_SHAPE = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _acc(context, builder, sig, args):
    return (_data(context, builder, sig.args[0], args[0]), _ACC, ir.FloatType(), "f")


@intrinsic
def wgmma_ss(typingctx, acc, sh, desc_a, desc_b, accumulate):
    sig = types.void(acc, sh, types.uint64, types.uint64, types.boolean)

    def codegen(context, builder, sig, args):
        text = "{ .reg .pred p; setp.ne.b32 p, $34, 0; " + _SHAPE + f" {_D}, $32, $33, p, 1, 1, 0, 0; }}"
        _tied(builder, text, [_I64, _I64, _I32], ["l", "l", "r"], [args[2], args[3], builder.zext(args[4], _I32)],
              [_acc(context, builder, sig, args)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def wgmma_rs_t(typingctx, acc, a0, a1, a2, a3, sh, desc_b, accumulate):
    sig = types.void(acc, *([types.uint32] * 4), sh, types.uint64, types.boolean)

    def codegen(context, builder, sig, args):
        text = "{ .reg .pred p; setp.ne.b32 p, $37, 0; " + _SHAPE + f" {_D}, {{$32,$33,$34,$35}}, $36, p, 1, 1, 1; }}"
        _tied(builder, text, [_I32] * 4 + [_I64, _I32], ["r"] * 4 + ["l", "r"],
              [*args[1:5], args[6], builder.zext(args[7], _I32)], [_acc(context, builder, sig, args)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def wgmma_fence(typingctx, acc, frag):
    """(frag: a (4, 4) uint32 array of A fragments the next products read, or acc again if none)"""
    def codegen(context, builder, sig, args):
        arrays = [_acc(context, builder, sig, args)]
        if sig.args[1].dtype == types.uint32:
            arrays.append((_data(context, builder, sig.args[1], args[1]), 16, _I32, "r"))
        _tied(builder, "wgmma.fence.sync.aligned;", [], [], [], arrays)
        return context.get_dummy_value()
    return types.void(acc, frag), codegen


@intrinsic
def wgmma_wait(typingctx, acc):
    def codegen(context, builder, sig, args):
        _tied(builder, "wgmma.wait_group.sync.aligned 0;", [], [], [], [_acc(context, builder, sig, args)])
        return context.get_dummy_value()
    return types.void(acc), codegen


def _plain(text):
    @intrinsic
    def instruction(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    return instruction


wgmma_commit = _plain("wgmma.commit_group.sync.aligned;")
proxy_fence = _plain("fence.proxy.async.shared::cta;")
