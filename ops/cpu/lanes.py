"""Eight float32 lanes as one value, for kernels whose inner loops LLVM does not vectorize by itself.

LLVM vectorizes a long dot product well, but not the quantized products' groups of 32 weights,
each with its own scale: a vectorized loop ends each group with a horizontal sum, and a loop of
a constant 16 or 32 trips is unrolled and then vectorized along the wrong axis. `Lanes` is LLVM's
<8 x float> (one AVX register; two SSE or NEON ones elsewhere), so a kernel keeps one vector
accumulator per output across all its groups and sums the lanes once, at the end:

    acc = splat(np.float32(0))
    for block ...:
        acc = splat(scale) * (load(x, k) * load_int8(q, k) + ...) + acc
    out = total(acc)

`*` and `+` on Lanes are lane by lane; a product added right away becomes one fused multiply-add
where the machine has one (as `contract` allows scalar code). Loads read 8 consecutive elements
of a C-contiguous array from a flat index (element i of its memory order), unchecked: the caller
keeps them inside the array.
"""

import operator

from llvmlite import ir
from numba import types
from numba.core import cgutils
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
def load(typingctx, a, i):
    """Float32 a[i : i + 8] (flat index) as Lanes."""
    _check_array(a, types.float32, "load")

    def codegen(context, builder, signature, args):
        return builder.load(_address(context, builder, signature.args[0], args[0], args[1], _FLOATS), align=4)
    return Lanes(a, i), codegen


@intrinsic
def store(typingctx, a, i, v):
    """a[i : i + 8] = v (float32 a, flat index)."""
    _check_array(a, types.float32, "store")

    def codegen(context, builder, signature, args):
        builder.store(args[2], _address(context, builder, signature.args[0], args[0], args[1], _FLOATS), align=4)
        return context.get_dummy_value()
    return types.none(a, i, Lanes), codegen


@intrinsic
def load_int8(typingctx, a, i):
    """Int8 a[i : i + 8] (flat index), converted to float32 Lanes."""
    _check_array(a, types.int8, "load_int8")

    def codegen(context, builder, signature, args):
        eight = ir.VectorType(ir.IntType(8), WIDTH)
        return builder.sitofp(builder.load(_address(context, builder, signature.args[0], args[0], args[1], eight),
                                           align=1), _FLOATS)
    return Lanes(a, i), codegen


@intrinsic
def load_nibbles(typingctx, a, i):
    """The 32 nibbles of uint8 a[i : i + 16] (flat index) as four float32 Lanes: the low nibbles of
    bytes 0-7, of bytes 8-15, then the high nibbles of bytes 0-7 and of bytes 8-15. In a 4-bit
    block (nanoeuler_core/quantized.py) these are its weights 0-7, 8-15, 16-23 and 24-31."""
    _check_array(a, types.uint8, "load_nibbles")

    def codegen(context, builder, signature, args):
        # each 8 bytes widened to 32-bit lanes first, then masked and shifted there: one widening
        # per 8 bytes (not one per nibble) and no byte shuffles
        bytes8 = ir.VectorType(ir.IntType(8), WIDTH)
        words = ir.VectorType(ir.IntType(32), WIDTH)
        index = args[1]
        halves = [builder.zext(builder.load(_address(context, builder, signature.args[0], args[0], at, bytes8), align=1), words)
                  for at in (index, builder.add(index, ir.Constant(index.type, WIDTH)))]
        low = [builder.and_(h, ir.Constant(words, [15] * WIDTH)) for h in halves]
        high = [builder.lshr(h, ir.Constant(words, [4] * WIDTH)) for h in halves]
        return context.make_tuple(builder, signature.return_type, [builder.sitofp(v, _FLOATS) for v in low + high])
    return types.UniTuple(Lanes, 4)(a, i), codegen


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
