"""AdamW over the model's flat parameter buffer, and the learning-rate schedule (SPEC.md section 3).

One call of the registered `adamw` op computes the global gradient norm, clips, and updates every
parameter; weight decay covers the matrices, which the model lays out first ([0, n_decay)).

Data parallelism enters through a `Collectives` object (nanoeuler_core.training.distributed makes
them; the engine knows only this interface). Between the backward and the update, AdamW sums the
gradient buffer over the ranks (all-reduce), or, with sharded optimizer state (ZeRO-1), sums each
rank's slice of it (reduce-scatter), updates that slice with its share of the moments and clips by
the global norm, then gathers the updated slices (all-gather). The calls on backend arrays are
backend work, so a captured CUDA graph holds them.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from nanoeuler_core import registry


class Collectives(Protocol):
    """Communication among `size` data-parallel ranks, this one being `rank`.

    Backend arrays are flat and reduced in place; `shard(n)` is the slice [lo, hi) of an n-long
    buffer that this rank owns (n must be a multiple of size).
    """

    rank: int
    size: int

    def all_reduce_sum(self, buf) -> None:
        """buf <- the sum of every rank's buf."""

    def reduce_scatter_sum(self, buf) -> None:
        """buf[lo:hi] <- the sum of every rank's buf[lo:hi], for this rank's shard; the rest of buf is left undefined."""

    def all_gather(self, buf) -> None:
        """buf[shard of rank r] <- rank r's buf[shard of rank r], for every r."""

    def host_sum(self, values: np.ndarray) -> np.ndarray:
        """The sum over the ranks of a small host array."""

    def host_concat(self, values: np.ndarray) -> np.ndarray:
        """Every rank's host array, concatenated in rank order (on every rank)."""


def shard(n: int, rank: int, size: int) -> tuple[int, int]:
    """The slice [lo, hi) of an n-long buffer that `rank` of `size` owns."""
    per_rank = n // size
    return rank * per_rank, (rank + 1) * per_rank


def lr_at(step: int, peak: float, warmup: int, total: int, final_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `final_ratio * peak` at `total` (1-based step)."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    """AdamW with global gradient-norm clipping; with `comm`, data-parallel over its ranks, and with
    `zero`, each rank keeps the moments of its shard of the parameters only (ZeRO-1)."""

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: bool = False):
        self.model = model
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.max_grad_norm = eps, weight_decay, max_grad_norm
        self.comm, self.zero = comm, zero
        self.lo, self.hi = 0, model.n_params  # the parameters whose moments this rank keeps
        if zero:
            if comm is None:
                raise ValueError("sharded optimizer state (--zero 1) needs data-parallel ranks (mpiexec)")
            if model.n_params % comm.size:
                raise ValueError(f"--zero 1 splits the {model.n_params:,} parameters evenly over the ranks: "
                                 f"{comm.size} ranks do not divide them; use a rank count that does, or no --zero")
            self.lo, self.hi = shard(model.n_params, comm.rank, comm.size)
        be = model.backend
        self.m = be.zeros(self.hi - self.lo)
        self.v = be.zeros(self.hi - self.lo)
        self.sched = be.zeros(2)  # [lr, step] on the backend: a captured step reads them from here
        self.step_count = 0
        self._adamw = registry.op("adamw").impl(model.backend_name).forward

    def set_schedule(self, lr: float) -> None:
        """Start the next step at learning rate `lr` (host work: call before `update`)."""
        self.step_count += 1
        self.model.backend.copy_(self.sched, np.array([lr, self.step_count], dtype=self.model.backend.dtype))

    def update(self):
        """Sum the gradient buffer over the ranks, clip and apply it to the master weights, then
        refresh the copy the model computes with (backend work only); returns the norm (1,) on the
        backend."""
        model, comm, lo, hi = self.model, self.comm, self.lo, self.hi
        hyper = dict(beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                     max_grad_norm=self.max_grad_norm)
        if not self.zero:
            if comm is not None:
                comm.all_reduce_sum(model.grad_flat)
            norm, _ = self._adamw(model.flat, model.grad_flat, self.m, self.v, self.sched, n_decay=model.n_decay,
                                  **hyper)
            model.refresh_compute_weights()
            return norm
        comm.reduce_scatter_sum(model.grad_flat)
        norm, _ = self._adamw(model.flat[lo:hi], model.grad_flat[lo:hi], self.m, self.v, self.sched,
                              n_decay=min(max(model.n_decay - lo, 0), hi - lo),
                              reduce_sum_squares=comm.all_reduce_sum, **hyper)
        comm.all_gather(model.flat)
        model.refresh_compute_weights()
        return norm

    def step(self, lr: float) -> float:
        """Apply one update from the model's gradient buffer; returns the gradient norm before clipping."""
        self.set_schedule(lr)
        return float(self.model.backend.to_host(self.update())[0])

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Moments as named tensors (m.<name>, v.<name>) and the step, for optimizer.safetensors.

        With sharded moments every rank must call it (it gathers the shards)."""
        be, layout = self.model.backend, self.model.layout
        m, v = be.to_host(self.m), be.to_host(self.v)
        if self.zero:
            m, v = self.comm.host_concat(m), self.comm.host_concat(v)
        tensors = {}
        for name, (offset, shape) in layout.items():
            size = int(np.prod(shape))
            tensors[f"m.{name}"] = m[offset:offset + size].reshape(shape)
            tensors[f"v.{name}"] = v[offset:offset + size].reshape(shape)
        return tensors, {"step": str(self.step_count)}

    def load_state(self, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        be, layout = self.model.backend, self.model.layout
        m = np.empty(self.model.n_params, dtype=be.dtype)
        v = np.empty(self.model.n_params, dtype=be.dtype)
        for name, (offset, shape) in layout.items():
            size = int(np.prod(shape))
            for flat, key in ((m, f"m.{name}"), (v, f"v.{name}")):
                if key not in tensors or tensors[key].shape != shape:
                    raise ValueError(f"optimizer state lacks '{key}' of shape {shape}")
                flat[offset:offset + size] = tensors[key].reshape(-1)
        be.copy_(self.m, m[self.lo:self.hi])
        be.copy_(self.v, v[self.lo:self.hi])
        self.step_count = int(metadata.get("step", 0))


class TrainStep:
    """One optimisation step (forward and backward of each micro-batch, the gradients summed in
    the model's buffer and over the optimizer's ranks, clipping, AdamW) on micro-batches of one shape.

    The micro-batches are copied into device buffers that stay put, so the step itself is backend
    work only: the backend captures it once per shape and micro-batch count (a CUDA graph) and
    replays it; the CPU backends run it as is. `capture=False` keeps every launch eager, for debugging.
    """

    def __init__(self, model, optimizer: AdamW, capture: bool = True):
        self.model, self.optimizer, self.capture = model, optimizer, capture
        self._programs: dict = {}

    def __call__(self, inputs, targets, lr: float) -> tuple[float, float]:
        """Train on one batch; returns (loss, gradient norm before clipping)."""
        return self.micro_batches([(inputs, targets)], lr)

    def micro_batches(self, batches: list[tuple[np.ndarray, np.ndarray]], lr: float) -> tuple[float, float]:
        """Train on micro-batches [(inputs, targets), ...], one step over all their rows (and over
        every rank's micro-batches): the MTP weights count the targets of the whole step. Returns
        (loss, gradient norm before clipping), both of the whole step."""
        model, be, comm = self.model, self.model.backend, self.optimizer.comm
        ids = [model._check_inputs(inputs) for inputs, _ in batches]
        if len({i.shape for i in ids}) != 1:
            raise ValueError(f"micro-batches of one step must share a shape, got {sorted({i.shape for i in ids})}")
        head_targets = [model.head_targets(model._check_targets(targets, i)) for (_, targets), i in zip(batches, ids)]
        counts = sum((h >= 0).sum(axis=1) for h in head_targets)
        if comm is not None:
            counts = comm.host_sum(counts)
        weights = [model.mtp_weights(h, counts) for h in head_targets]
        host = (np.stack([i.reshape(-1) for i in ids]), np.stack(head_targets), np.stack(weights))
        self.optimizer.set_schedule(lr)
        key = (len(batches), ids[0].shape)
        program = self._programs.get(key)
        if program is None:
            buffers = tuple(be.asarray(a) for a in host)

            def step():
                losses = [model._forward_backward(buffers[0][k], buffers[1][k], buffers[2][k], *ids[0].shape,
                                                  accumulate=k > 0) for k in range(len(batches))]
                return losses, self.optimizer.update()

            replay, result = be.capture(step) if self.capture else (step, step())
            self._programs[key] = (buffers, replay)
        else:
            buffers, replay = program
            for buffer, values in zip(buffers, host):
                be.copy_(buffer, values)
            result = replay()
        losses, norm = result
        loss = sum(float((w * model._host_losses(l)).sum()) for w, l in zip(weights, losses))
        if comm is not None:
            loss = float(comm.host_sum(np.array([loss]))[0])
        return loss, float(be.to_host(norm)[0])
