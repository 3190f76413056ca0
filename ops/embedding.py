"""Token embedding: each id picks one row of the table.

Shapes: ids (N,) int64 in [0, V), table (V, C) -> out (N, C), out[n] = table[ids[n]]; saved ().
Backward: dtable[v] = sum of dout[n] over the n with ids[n] == v (a repeated id adds up; rows of
unused ids are 0). The ids get no gradient.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op
from nanoeuler_ops import accumulated


def check_ids(ids, vocab_size):
    """Raise ValueError for ids outside [0, V): they would read or write outside the table."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got ids from {ids.min()} to {ids.max()}: "
                         f"encode the data with the tokenizer the model was built for")


def forward(ids, table):
    check_ids(ids, table.shape[0])
    return table[ids], ()


def backward(dout, saved, ids, table, *, into=None):
    dtable = np.zeros_like(table)
    np.add.at(dtable, ids, dout)
    return accumulated((None, dtable), into)


def sample_inputs(rng):
    # (N, V, C): a single id; ids repeated many times over a small table; odd sizes, unused rows.
    for n, v, c in ((1, 3, 1), (12, 4, 5), (37, 29, 19)):
        ids = rng.integers(0, v, size=n, dtype=np.int64)
        table = rng.standard_normal((v, c))
        yield Sample((ids, table), grad_inputs=(1,), name=f"N{n}_V{v}_C{c}")


def error_inputs(rng):
    table = rng.standard_normal((5, 3))
    for name, ids in (("id_V", [0, 5, 1]), ("id_minus_1", [2, -1])):
        yield ErrorInput(Sample((np.array(ids, dtype=np.int64), table), name=name),
                         match=r"token ids must lie in \[0, 5\)")


def model_inputs(rng, cfg, rows):
    ids = rng.integers(0, cfg.vocab_size, rows)
    table = 0.02 * rng.standard_normal((cfg.vocab_size, cfg.dim))
    return Sample((ids, table), grad_inputs=(1,), name=f"N{rows}_V{cfg.vocab_size}_C{cfg.dim}")


OP = define_op(globals(), "Token embedding lookup (rows of a table by id)",
                tol=Tol(rtol=1e-5, atol=1e-6), accumulates=(1,), precisions={"cuda": ("bf16",)})
