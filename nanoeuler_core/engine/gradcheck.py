"""Registry-driven gradient checking.

For every registered op and every sample it yields:
  * the reference backward agrees with central finite differences (float64);
  * every pair of backends agrees on the forward and the backward, within the op's `tol`;
  * in each reduced precision an op declares (tf32, bf16), the backends running it agree with the
    float32 ones and the float64 reference, within that precision's bound (`Op.tol_for`), on
    inputs rounded to what that precision stores;
  * for the inputs an op `accumulates`, a backward that adds into given arrays (`into`) agrees
    across the backends too, starting from the same random contents;
  * every backend refuses each of the op's `error_inputs` with the error and message it declares.

A backend that lacks an op's kernels is simply not among that op's backends; the model checks
skip a backend that lacks any op the model needs.

A new op, backend or precision is checked without writing a test: `check_op` walks whatever is
registered. The full-model checks (every parameter tensor against finite differences, and each
backend against another) are `check_model_finite_differences` and `check_model_backend`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.registry import Op, Sample

# The reference backward against central differences (L(x + h) - L(x - h)) / 2h in float64, whose
# error is about h^2 L''' / 6 plus a rounding error of about 1e-16 |L| / h: near 1e-10 with h = 1e-6
# where L is smooth. Within h of a kink (relu at 0, a max that changes hands) the two sides see
# different slopes and the check fails whatever h is: an op's samples keep away from its kinks.
FD_STEP = 1e-6
FD_TOL = (1e-5, 1e-7)        # (rtol, atol): |analytic - numeric| <= atol + rtol |numeric|, elementwise
FD_MAX_ELEMENTS = 48          # per input: larger inputs are probed at random elements
FD_FAILURE_HINT = (f"finite differences with step {FD_STEP:g}, bound {FD_TOL[1]:g} + {FD_TOL[0]:g} |numeric|: "
                   f"usually a sample within a step of a kink (e.g. relu at 0): keep samples away from kinks")


@dataclass
class Check:
    """One comparison: `what` (e.g. "forward", "grad x0") between `a` and `b` on one sample."""

    op: str
    sample: str
    a: str
    b: str
    what: str
    max_abs: float
    max_rel: float
    ok: bool
    hint: str = ""        # what a failure usually means, printed with it

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        hint = f"  ({self.hint})" if self.hint and not self.ok else ""
        return (f"{status} {self.op:<14} {self.sample:<16} {self.a + ' vs ' + self.b:<22} "
                f"{self.what:<10} max abs {self.max_abs:.1e}  max rel {self.max_rel:.1e}{hint}")


def _compare(op: Op, sample: Sample, a: str, b: str, what: str, x, y, rtol, atol) -> Check:
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        return Check(op.name, sample.name, a, b, what + f" shape {x.shape} != {y.shape}", np.inf, np.inf, False)
    diff = np.abs(x - y)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(y), 1e-30)).max()) if diff.size else 0.0
    ok = bool(np.all(np.isfinite(x)) and np.all(diff <= atol + rtol * np.abs(y)))
    return Check(op.name, sample.name, a, b, what, max_abs, max_rel, ok)


def stored_values(x: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """Float values rounded to what `precision` stores (float32, or bfloat16's 8 significant bits),
    as float64: every backend then starts from the same numbers and differs only in its arithmetic."""
    x = np.asarray(x, dtype=np.float32)
    if registry.precision(precision).storage == "bf16":
        x = registry.bf16_values(registry.bf16_bits(x))
    return x.astype(np.float64)


def _rounded(sample: Sample, precision: str = "fp32") -> tuple:
    return tuple(stored_values(x, "fp32" if i in sample.float32_inputs else precision)
                 if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x for i, x in enumerate(sample.inputs))


def run_backend(op: Op, backend_name: str, inputs: tuple, attrs: dict, dout=None, precision: str = "fp32",
                into: dict | None = None, float32_inputs: tuple[int, ...] = ()):
    """Forward (and backward with `dout`, if the op has one) on one backend; host arrays back.

    `precision` applies where the op runs in it on this backend (else the backend runs fp32): in
    bf16 the float inputs are stored as bf16 (but `float32_inputs`), and dout in the storage of the
    forward's output.
    `into` {input position: host array} runs the backward adding into arrays holding those values
    (in the storage of that input's gradient), and returns what they hold afterwards.
    Returns (outputs, grads): outputs is the forward's result followed by each in-place input
    after the call; grads is one host array (or None) per input.
    """
    be = registry.backend(backend_name)
    if precision not in op.precisions_on(backend_name):
        precision = "fp32"
    impl = op.impl(backend_name, precision)
    storage = registry.precision(precision).storage
    args = tuple((be.asarray(x, storage if x.dtype.kind == "f" and i not in float32_inputs else None)
                  if isinstance(x, np.ndarray) else x) for i, x in enumerate(inputs))
    with be.computing():
        out, saved = impl.forward(*args, **attrs)
        outputs = [be.to_host(o) for o in _outputs(out)] + [be.to_host(args[i]) for i in op.inplace]
        grads = None
        if dout is not None and op.differentiable:
            douts = tuple(be.asarray(d, storage if _low(o) else None) for d, o in zip(_outputs(dout), _outputs(out)))
            dout_arg = douts if isinstance(out, tuple) else douts[0]
            grads = impl.backward(dout_arg, saved, *args, **attrs)
            if into:
                targets = tuple(be.asarray(into[i], storage if _low(grads[i]) else None) if i in into else None
                                for i in range(len(args)))
                grads = impl.backward(dout_arg, saved, *args, into=targets, **attrs)
            grads = [None if g is None else be.to_host(g) for g in grads]
    return outputs, grads


def _low(arr) -> bool:
    """Whether a backend array is stored in bf16 (as its bit patterns)."""
    return getattr(arr, "dtype", None) == np.uint16


def _outputs(out) -> tuple:
    """An op's output as a tuple (ops with several outputs return a tuple of arrays)."""
    return out if isinstance(out, tuple) else (out,)


def random_like(out, rng: np.random.Generator, precision: str = "fp32"):
    """Random weights shaped like an op's output (a tuple for several outputs), rounded to `precision`."""
    weights = tuple(stored_values(rng.standard_normal(np.shape(o)), precision) for o in _outputs(out))
    return weights if isinstance(out, tuple) else weights[0]


def finite_difference_check(op: Op, sample: Sample, rng: np.random.Generator) -> list[Check]:
    """The reference backward against central differences of L = sum(out * R), in float64."""
    inputs = [x.copy() if isinstance(x, np.ndarray) else x for x in _rounded(sample)]
    out, saved = op.reference.forward(*inputs, **sample.attrs)
    weights = random_like(out, rng)
    grads = op.reference.backward(weights, saved, *inputs, **sample.attrs)

    def loss() -> float:
        outputs = _outputs(op.reference.forward(*inputs, **sample.attrs)[0])
        return float(sum(np.sum(o * w) for o, w in zip(outputs, _outputs(weights))))

    checks = []
    for i in sample.grad_inputs:
        x = inputs[i]
        flat = x.reshape(-1)
        probe = np.arange(flat.size)
        if flat.size > FD_MAX_ELEMENTS:
            probe = rng.choice(flat.size, FD_MAX_ELEMENTS, replace=False)
        numeric = np.empty(probe.size)
        for j, e in enumerate(probe):
            keep = flat[e]
            flat[e] = keep + FD_STEP
            up = loss()
            flat[e] = keep - FD_STEP
            down = loss()
            flat[e] = keep
            numeric[j] = (up - down) / (2 * FD_STEP)
        analytic = np.asarray(grads[i]).reshape(-1)[probe]
        check = _compare(op, sample, "reference", "finite diff", f"grad x{i}", analytic, numeric, *FD_TOL)
        check.hint = FD_FAILURE_HINT
        checks.append(check)
    return checks


def backend_pair_checks(op: Op, sample: Sample, backends: list[str], rng: np.random.Generator,
                        precision: str = "fp32") -> list[Check]:
    """Forward and backward of every pair of `backends` on one sample. In a reduced precision,
    only the pairs where one side runs that precision (the others ran at fp32 already)."""
    inputs = _rounded(sample, precision)
    dout = None
    if op.differentiable:
        dout = random_like(op.reference.forward(*inputs, **sample.attrs)[0], rng, precision)
    results = {name: run_backend(op, name, inputs, sample.attrs, dout, precision, float32_inputs=sample.float32_inputs)
               for name in backends}
    accumulating = [i for i in op.accumulates if i in sample.grad_inputs] if op.differentiable else []
    if accumulating:   # a backward adding into arrays that already hold something
        into = {i: stored_values(rng.standard_normal(np.shape(inputs[i])), precision) for i in accumulating}
        added = {name: run_backend(op, name, inputs, sample.attrs, dout, precision, into, sample.float32_inputs)[1]
                 for name in backends}
    tol = op.tol_for(precision, sample)
    checks = []
    for a, b in combinations(backends, 2):
        if precision != "fp32" and precision not in op.precisions_on(a) + op.precisions_on(b):
            continue
        label_a = a if precision == "fp32" or precision not in op.precisions_on(a) else f"{a}:{precision}"
        label_b = b if precision == "fp32" or precision not in op.precisions_on(b) else f"{b}:{precision}"
        (out_a, grads_a), (out_b, grads_b) = results[a], results[b]
        n_out = len(out_a) - len(op.inplace)
        for k, (x, y) in enumerate(zip(out_a, out_b)):
            what = ("forward" if n_out == 1 else f"forward y{k}") if k < n_out else f"inplace x{op.inplace[k - n_out]}"
            checks.append(_compare(op, sample, label_a, label_b, what, x, y, tol.rtol, tol.atol))
        for i in sample.grad_inputs if op.differentiable else ():
            checks.append(_compare(op, sample, label_a, label_b, f"grad x{i}", grads_a[i], grads_b[i],
                                   tol.rtol, tol.atol))
        for i in accumulating:
            checks.append(_compare(op, sample, label_a, label_b, f"grad x{i} +=", added[a][i], added[b][i],
                                   tol.rtol, tol.atol))
    return checks


@dataclass
class RefusalCheck:
    """Whether `backend` refused one of an op's error inputs as the op declares: `got` is what
    happened instead ("" when refused as declared)."""

    op: str
    sample: str
    backend: str
    expected: str
    got: str

    @property
    def ok(self) -> bool:
        return not self.got

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        return f"{status} {self.op:<14} {self.sample:<16} {self.backend:<22} refuses: {self.expected}" + \
            ("" if self.ok else f"; got {self.got}")


def refusal_checks(op: Op, backends: list[str] | None = None, seed: int = 0) -> list[RefusalCheck]:
    """Each of the op's error inputs on each of its usable `backends` (all by default): the forward
    must raise the declared error with a message its pattern finds."""
    if op.error_inputs is None:
        return []
    names = available_backends(op, backends)
    host_arrays = {name: isinstance(registry.backend(name).asarray(np.zeros(1)), np.ndarray) for name in names}
    checks = []
    for case in op.error_inputs(np.random.default_rng(seed)):
        expected = f'{case.error.__name__} matching "{case.match}"'
        for name in names:
            if case.host_values and not host_arrays[name]:
                continue   # a device backend leaves these values to its caller
            be = registry.backend(name)
            args = tuple(be.asarray(x) if isinstance(x, np.ndarray) else x for x in case.sample.inputs)
            try:
                op.impl(name).forward(*args, **case.sample.attrs)
            except case.error as exc:
                got = "" if re.search(case.match, str(exc)) else f"the message {str(exc)!r}"
            except Exception as exc:   # what the backend raised instead: the check's result
                got = f"{type(exc).__name__}: {exc}"
            else:
                got = "no error"
            checks.append(RefusalCheck(op.name, case.sample.name, name, expected, got))
    return checks


def available_backends(op: Op, only: list[str] | None = None) -> list[str]:
    """The op's backends that can run here (a CUDA backend needs a GPU or the simulator)."""
    names = []
    for name in op.backend_names():
        be = registry.backends().get(name)
        if be is None or not be.available():
            continue
        if only and name not in only and not be.ground_truth:
            continue
        names.append(name)
    return names


def op_precisions(op: Op, backends: list[str] | None = None) -> list[str]:
    """The precisions `op` runs in on the usable ones of `backends`, fp32 first."""
    found = {p for name in available_backends(op, backends) for p in op.precisions_on(name)
             if registry.precision(p) in registry.backend(name).precisions}
    return [p for p in registry.PRECISIONS if p in found]


def runs_model(backend: str) -> bool:
    """Whether `backend` has every op the model needs (else the model checks skip it)."""
    from nanoeuler_core.engine.model import MODEL_OPS

    return all(backend in registry.op(name).backend_names() for name in MODEL_OPS)


def check_op(op: Op, backends: list[str] | None = None, seed: int = 0, precision: str = "fp32") -> list[Check]:
    """All checks of one op in one precision: at fp32, finite differences on the reference, then
    every backend pair; in a reduced precision, its backends against the others."""
    rng = np.random.default_rng(seed)
    names = available_backends(op, backends)
    if precision != "fp32":
        names = [n for n in names if precision not in op.precisions_on(n)
                 or registry.precision(precision) in registry.backend(n).precisions]
    checks = []
    for sample in op.sample_inputs(rng):
        if precision not in sample.precisions:
            continue
        if op.differentiable and precision == "fp32":
            checks += finite_difference_check(op, sample, rng)
        checks += backend_pair_checks(op, sample, names, rng, precision)
    return checks


# ------------------------------------------------------------------------------------------------
# the whole model

MODEL_FD_STEP = 1e-4
MODEL_FD_BOUND = 2e-5         # reference (float64) analytic vs finite differences, relative to the tensor's scale
MODEL_BACKEND_BOUND = 1e-4    # a float32 backend's gradients vs the reference's, relative to the tensor's scale
# a backend's loss and gradients vs the float32 CPU's in each precision, relative to the tensor's scale
MODEL_PRECISION_BOUND = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 5e-2}
MODEL_FD_PROBES = 6           # elements probed per parameter tensor


def tiny_config(tie_embeddings: bool = False):
    """A model small enough for finite differences in seconds, still exercising GQA, MTP and RoPE
    (and, with `tie_embeddings`, head 0 reading the embedding table)."""
    from nanoeuler_core.engine.config import ModelConfig

    return ModelConfig(vocab_size=11, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=12, ctx_len=6, n_mtp=2,
                       tie_embeddings=tie_embeddings)


def tiny_batch(cfg, rng, B: int = 2, T: int = 5):
    inputs = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, 1] = -1  # an ignored target, as SFT prompts are
    return inputs, targets


@dataclass
class TensorCheck:
    tensor: str
    max_rel_err: float
    bound: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_rel_err) and self.max_rel_err <= self.bound)

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.tensor + ':':<21} max rel err {self.max_rel_err:.1e}  (bound {self.bound:.0e})"


def _scaled_error(a: np.ndarray, b: np.ndarray, scale: np.ndarray) -> float:
    """max |a - b| relative to the largest |scale| (elementwise ratios explode near zero gradients)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(scale))), 1e-12))


def check_model_finite_differences(seed: int = 0, cfg=None) -> list[TensorCheck]:
    """Every parameter tensor's analytic gradient (reference backend, float64) against central differences."""
    from nanoeuler_core.engine.model import Model

    cfg = cfg or tiny_config()
    rng = np.random.default_rng(seed)
    model = Model(cfg, backend="reference", seed=seed)
    inputs, targets = tiny_batch(cfg, rng)
    _, grads = model.loss_and_grad(inputs, targets)
    params = model.params  # views into the float64 parameter buffer
    checks = []
    for name, w in params.items():
        flat = w.reshape(-1)
        probe = rng.choice(flat.size, min(MODEL_FD_PROBES, flat.size), replace=False)
        numeric = np.empty(probe.size)
        for j, e in enumerate(probe):
            keep = flat[e]
            flat[e] = keep + MODEL_FD_STEP
            up = model.loss(inputs, targets)
            flat[e] = keep - MODEL_FD_STEP
            down = model.loss(inputs, targets)
            flat[e] = keep
            numeric[j] = (up - down) / (2 * MODEL_FD_STEP)
        checks.append(TensorCheck(name, _scaled_error(grads[name].reshape(-1)[probe], numeric, grads[name]), MODEL_FD_BOUND))
    return checks


def check_model_backend(backend: str, seed: int = 0, against: str = "reference", cfg=None, batch_size: int = 2,
                        bound: float = MODEL_BACKEND_BOUND, precision: str = "fp32") -> list[TensorCheck]:
    """One backend's loss and every gradient tensor, in `precision`, against another backend's
    (the float64 reference by default) on the same weights and batch (weights rounded to what
    `precision` stores); errors relative to each tensor's scale."""
    from nanoeuler_core.engine.model import Model

    cfg = cfg or tiny_config()
    rng = np.random.default_rng(seed)
    base = Model(cfg, backend=against, seed=seed, precision="fp32")
    other = Model(cfg, backend=backend, seed=seed, precision=precision)
    other.load_params({n: stored_values(w, precision) for n, w in base.params.items()})
    base.load_params(other.params)  # both on the same rounded weights
    inputs, targets = tiny_batch(cfg, rng, B=batch_size, T=cfg.ctx_len)
    loss_base, grads_base = base.loss_and_grad(inputs, targets)
    loss_other, grads_other = other.loss_and_grad(inputs, targets)
    checks = [TensorCheck("loss", abs(loss_other - loss_base) / abs(loss_base), bound)]
    checks += [TensorCheck(name, _scaled_error(grads_other[name], g, g), bound) for name, g in grads_base.items()]
    return checks
