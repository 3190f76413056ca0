"""Residual add then RMSNorm on the CPU, one pass over the rows each way: the rmsnorm kernels with
the add taken in. See ops/add_rmsnorm.py."""

import numpy as np

from nanoeuler_ops import accumulated
from nanoeuler_ops.add_rmsnorm import check_shapes
from nanoeuler_ops.cpu.rmsnorm import backward_rows, normalize_rows


def forward(x, branch, w, *, eps):
    # x, branch (N, C), w (C,) -> (s = x + branch, y = rmsnorm(s)); saved (s, rstd (N,))
    check_shapes(x, branch, w)
    s = np.empty_like(x)
    y = np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)
    normalize_rows(x, branch, True, w, np.float32(eps), s, y, rstd)
    return (s, y), (s, rstd)


def backward(dout, saved, x, branch, w, *, eps, into=None):
    # (ds, dy) -> dx = dbranch (N, C) (the same array), dw (C,) added into into[2] where given
    ds, dy = dout
    s, rstd = saved
    dx, dw = backward_rows(dy, s, w, rstd, ds)
    (dw,) = accumulated((dw,), into[2:] if into else None)
    return dx, dx, dw
