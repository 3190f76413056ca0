"""Residual add then RMSNorm on the CPU: the add and rmsnorm kernels. See nanoeuler_ops/add_rmsnorm.py."""

from nanoeuler_ops.cpu import add, rmsnorm


def forward(x, branch, w, *, eps):
    s, _ = add.forward(x, branch)
    y, (rstd,) = rmsnorm.forward(s, w, eps=eps)
    return (s, y), (s, rstd)


def backward(dout, saved, x, branch, w, *, eps, into=None):
    ds, dy = dout
    s, rstd = saved
    dx, dw = rmsnorm.backward(dy, (rstd,), s, w, eps=eps, into=(None, into[2]) if into else None)
    if ds is not None:
        dx, _ = add.forward(dx, ds)
    return dx, dx, dw
