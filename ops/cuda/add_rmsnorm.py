"""Residual add then RMSNorm on the GPU: one pass forward, one backward (the rmsnorm kernels with
their residual variants). See ops/add_rmsnorm.py for the math."""

from nanoeuler_ops.add_rmsnorm import check_shapes
from nanoeuler_ops.cuda import rmsnorm


def forward(x, branch, w, *, eps):
    check_shapes(x, branch, w)
    return rmsnorm.add_forward(x, branch, w, eps=eps)


def backward(dout, saved, x, branch, w, *, eps, into=None):
    ds, dy = dout
    s, rstd = saved
    dx, dw = rmsnorm.backward(dy, (rstd,), s, w, eps=eps, ds=ds, into=(None, into[2]) if into else None)
    return dx, dx, dw
