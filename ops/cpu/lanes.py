"""SIMD values for the quantized products' inner loops: eight float32 lanes (`Lanes`) and 32
bytes (`Bytes`), with the operations those loops need, emitted as LLVM vector code.

LLVM vectorizes a long dot product well, but not a product by blocks of 32 weights, each block
with its own scale: a vectorized loop ends each block with a horizontal sum. Here a kernel loads
a block's 32 weights and its 32 activations rounded to int8 as Bytes, multiplies them as integers
(`int8_dot`, `nibble_dot`: 8 lanes of sums of 4 products, made float once), and keeps one Lanes
accumulator per output across all its blocks, summing the lanes once, at the end:

    acc = splat(np.float32(0))
    for block ...:
        acc = splat(d * scale) * int8_dot(load_bytes(q, k), load_bytes(xq, k)) + acc
    out = total(acc)

`*` and `+` on Lanes are lane by lane; a product added right away becomes one fused multiply-add
where the machine has one (as `contract` allows scalar code). Loads read consecutive elements of
a C-contiguous array from a flat index (element i of its memory order), unchecked: the caller
keeps them inside the array.
"""

import operator

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features
from numba.core.errors import TypingError
from numba.extending import intrinsic, models, overload, register_model

WIDTH = 8
_FLOATS = ir.VectorType(ir.FloatType(), WIDTH)
_FLAGS = ("contract",)   # a product feeding a sum may fuse into one multiply-add (as REDUCE_FASTMATH lets it)


class LanesType(types.Type):
    def __init__(self):
        super().__init__(name="Lanes")


Lanes = LanesType()


@register_model(LanesType)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _FLOATS)


def _indices(*values):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(values)), list(values))


def _check_array(a, dtype, name):
    if not (isinstance(a, types.Array) and a.layout == "C" and a.dtype == dtype):
        raise TypingError(f"{name}: needs a C-contiguous {dtype} array, got {a}")


def _address(context, builder, array_type, array, index, vector_type):
    # the address of element `index` (flat) of the array, as a pointer to `vector_type`
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [index]), vector_type.as_pointer())


@intrinsic
def splat(typingctx, s):
    """Lanes all equal to the float32 s."""
    if s != types.float32:
        raise TypingError(f"splat: needs a float32, got {s}")

    def codegen(context, builder, signature, args):
        one = builder.insert_element(ir.Constant(_FLOATS, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, one, _indices(*[0] * WIDTH))
    return Lanes(s), codegen


@intrinsic
def total(typingctx, v):
    """The float32 sum of the 8 lanes, always in the same order: ((0+4) + (2+6)) + ((1+5) + (3+7))."""
    if v != Lanes:
        raise TypingError(f"total: needs Lanes, got {v}")

    def codegen(context, builder, signature, args):
        x = args[0]
        fours = builder.fadd(builder.shuffle_vector(x, x, _indices(0, 1, 2, 3)), builder.shuffle_vector(x, x, _indices(4, 5, 6, 7)))
        twos = builder.fadd(builder.shuffle_vector(fours, fours, _indices(0, 1)), builder.shuffle_vector(fours, fours, _indices(2, 3)))
        return builder.fadd(builder.extract_element(twos, ir.Constant(ir.IntType(32), 0)),
                            builder.extract_element(twos, ir.Constant(ir.IntType(32), 1)))
    return types.float32(Lanes), codegen


def _lanewise(name):
    @intrinsic
    def operation(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, name)(args[0], args[1], flags=_FLAGS)
        return Lanes(Lanes, Lanes), codegen
    return operation


_add, _mul = _lanewise("fadd"), _lanewise("fmul")


@overload(operator.add)
def _overload_add(a, b):
    if a == Lanes and b == Lanes:
        return lambda a, b: _add(a, b)


@overload(operator.mul)
def _overload_mul(a, b):
    if a == Lanes and b == Lanes:
        return lambda a, b: _mul(a, b)


# ---------------------------------------------------------------- 8-bit blocks
# A quantized product multiplies 32 small integers at a time: 32 weights (int8, or 4-bit nibbles)
# by 32 activations rounded to int8. `Bytes` is LLVM's <32 x i8> (one AVX2 register); the dots
# give the integer sums of 4 consecutive products each, as 8 float32 lanes (lane l: products
# 4l..4l+3), exact: no product or sum of 4 leaves int32. With AVX2 they are its 8-bit multiply-adds
# (vpmaddubsw: unsigned x signed bytes, adjacent pairs summed to int16; vpmaddwd by ones: pairs of
# those summed to int32; for signed weights vpsignb moves each weight's sign onto its activation
# first, as llama.cpp does); elsewhere the same sums in generic vector code, chosen once, at import
# (`_quad_sums`), by the features Numba compiles for.

_BYTES = ir.VectorType(ir.IntType(8), 32)
_WORDS = ir.VectorType(ir.IntType(32), WIDTH)
AVX2 = "+avx2" in (numba.config.CPU_FEATURES or get_host_cpu_features()).split(",")


class BytesType(types.Type):
    def __init__(self):
        super().__init__(name="Bytes")


Bytes = BytesType()


@register_model(BytesType)
class _BytesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _BYTES)


@intrinsic
def load_bytes(typingctx, a, i):
    """Int8 a[i : i + 32] (flat index) as Bytes."""
    _check_array(a, types.int8, "load_bytes")

    def codegen(context, builder, signature, args):
        return builder.load(_address(context, builder, signature.args[0], args[0], args[1], _BYTES), align=1)
    return Bytes(a, i), codegen


@intrinsic
def load_nibble_block(typingctx, a, i):
    """The 32 nibbles of uint8 a[i : i + 16] (flat index) as Bytes in a 4-bit block's weight order
    (nanoeuler_core/quantized.py): the low nibbles of bytes 0-15, then their high nibbles."""
    _check_array(a, types.uint8, "load_nibble_block")

    def codegen(context, builder, signature, args):
        sixteen = ir.VectorType(ir.IntType(8), 16)
        packed = builder.load(_address(context, builder, signature.args[0], args[0], args[1], sixteen), align=1)
        low = builder.and_(packed, ir.Constant(sixteen, [15] * 16))
        high = builder.lshr(packed, ir.Constant(sixteen, [4] * 16))
        return builder.shuffle_vector(low, high, _indices(*range(32)))
    return Bytes(a, i), codegen


def _x86(builder, name, result, *args):
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [a.type for a in args]), name)
    return builder.call(function, args)


def _quad_sums_avx2(builder, weights, x, signed_weights):
    # <32 x i8> weights, x -> <8 x i32>: vpmaddubsw (weights unsigned: signed ones as |w| times x
    # with w's sign, vpsignb), then vpmaddwd by ones
    if signed_weights:
        weights, x = (_x86(builder, "llvm.abs.v32i8", _BYTES, weights, ir.Constant(ir.IntType(1), 0)),
                      _x86(builder, "llvm.x86.avx2.psign.b", _BYTES, x, weights))
    pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(ir.IntType(16), 16), weights, x)
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", _WORDS, pairs, ir.Constant(pairs.type, [1] * 16))


def _quad_sums_portable(builder, weights, x, signed_weights):
    # the same sums in generic vector code: products widened to int32, every fourth one added
    wide = ir.VectorType(ir.IntType(32), 32)
    products = builder.mul(builder.sext(weights, wide) if signed_weights else builder.zext(weights, wide),
                           builder.sext(x, wide))
    quads = [builder.shuffle_vector(products, products, _indices(*range(r, 32, 4))) for r in range(4)]
    return builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3]))


_quad_sums = _quad_sums_avx2 if AVX2 else _quad_sums_portable


def _dot(weights, x, signed_weights):
    # the typing and code of int8_dot and nibble_dot
    if weights != Bytes or x != Bytes:
        raise TypingError(f"a dot needs two Bytes, got {weights}, {x}")

    def codegen(context, builder, signature, args):
        return builder.sitofp(_quad_sums(builder, *args, signed_weights), _FLOATS)
    return Lanes(Bytes, Bytes), codegen


@intrinsic
def int8_dot(typingctx, weights, x):
    """Int8 weights (-127..127) times int8 x, both Bytes: Lanes, lane l the sum of products 4l..4l+3."""
    return _dot(weights, x, signed_weights=True)


@intrinsic
def nibble_dot(typingctx, nibbles, x):
    """Nibbles (0..15) times int8 x, both Bytes: Lanes, lane l the sum of products 4l..4l+3."""
    return _dot(nibbles, x, signed_weights=False)


@intrinsic
def prefetch(typingctx, a, i):
    """Ask for the cache line holding a[i] (flat index) to be brought in, for a read soon (a hint: no
    fault past the array's end, no wait)."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        raise TypingError(f"prefetch: needs a C-contiguous array, got {a}")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                                              "llvm.prefetch.p0")   # (address, read, keep in all levels, data)
        builder.call(hint, [builder.bitcast(builder.gep(data, [args[1]]), byte), ir.Constant(i32, 0),
                            ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), codegen


# ---------------------------------------------------------------- scales
# A block's scale and offset are float32 values stored as float32 or as float16 (nanoeuler_core/
# quantized.py): a float16 array reaches a kernel as its bit patterns (uint16), which Numba's CPU
# types cannot read as numbers. With F16C a half becomes a float32 in one instruction (vcvtph2ps,
# 8 at a time); elsewhere in integer arithmetic, exactly the same: its exponent and fraction
# shifted to float32's places read as a float32 2^112 times too small (subnormal halves too), and
# inf and NaN get float32's top exponent.

F16C = "+f16c" in (numba.config.CPU_FEATURES or get_host_cpu_features()).split(",")
_TWO_112 = 2.0 ** 112


def _halves_f16c(builder, bits):
    # <n x i16> float16 bits -> <n x float>
    n = bits.type.count
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)), ir.VectorType(ir.FloatType(), n))


def _halves_portable(builder, bits):
    n = bits.type.count
    words, floats = ir.VectorType(ir.IntType(32), n), ir.VectorType(ir.FloatType(), n)

    def constant(value, kind=words):
        return ir.Constant(kind, [value] * n)

    h = builder.zext(bits, words)
    shifted = builder.shl(builder.and_(h, constant(0x7FFF)), constant(13))
    scaled = builder.bitcast(builder.fmul(builder.bitcast(shifted, floats), constant(_TWO_112, floats)), words)
    special = builder.icmp_unsigned("==", builder.and_(h, constant(0x7C00)), constant(0x7C00))
    magnitude = builder.select(special, builder.or_(shifted, constant(0x7F800000)), scaled)
    sign = builder.shl(builder.and_(h, constant(0x8000)), constant(16))
    return builder.bitcast(builder.or_(magnitude, sign), floats)


_halves = _halves_f16c if F16C else _halves_portable


def _check_values(a, name):
    if not (isinstance(a, types.Array) and a.layout == "C" and a.dtype in (types.float32, types.uint16)):
        raise TypingError(f"{name}: needs a C-contiguous float32 array or float16 bits (uint16), got {a}")


def _load_values(context, builder, array_type, array, index, n):
    # <n x float>: elements index..index+n-1 of a float32 array or of float16 bits
    kind = ir.FloatType() if array_type.dtype == types.float32 else ir.IntType(16)
    values = builder.load(_address(context, builder, array_type, array, index, ir.VectorType(kind, n)), align=1)
    return values if array_type.dtype == types.float32 else _halves(builder, values)


@intrinsic
def value(typingctx, a, i):
    """a[i] (flat index) as a float32: of a float32 array, or of float16 bits (uint16)."""
    _check_values(a, "value")

    def codegen(context, builder, signature, args):
        values = _load_values(context, builder, signature.args[0], *args, 1)
        return builder.extract_element(values, ir.Constant(ir.IntType(32), 0))
    return types.float32(a, i), codegen


@intrinsic
def load_lanes(typingctx, a, i):
    """a[i : i + 8] (flat index) as Lanes: of a float32 array, or of float16 bits (uint16)."""
    _check_values(a, "load_lanes")

    def codegen(context, builder, signature, args):
        return _load_values(context, builder, signature.args[0], *args, WIDTH)
    return Lanes(a, i), codegen


@intrinsic
def broadcast(typingctx, v, i):
    """Lanes all equal to lane i (0..7, any integer value at run time) of v."""
    if v != Lanes or not isinstance(i, types.Integer):
        raise TypingError(f"broadcast: needs Lanes and an integer, got {v}, {i}")

    def codegen(context, builder, signature, args):
        if AVX2:   # vpermps: one instruction, lane i to every place
            index = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
            index = builder.trunc(index, ir.IntType(32))
            first = builder.insert_element(ir.Constant(_WORDS, ir.Undefined), index, ir.Constant(ir.IntType(32), 0))
            indices = builder.shuffle_vector(first, ir.Constant(_WORDS, ir.Undefined), _indices(*[0] * WIDTH))
            return _x86(builder, "llvm.x86.avx2.permps", _FLOATS, args[0], indices)
        one = builder.extract_element(args[0], args[1])
        one = builder.insert_element(ir.Constant(_FLOATS, ir.Undefined), one, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, one, _indices(*[0] * WIDTH))
    return Lanes(v, i), codegen

