"""AdamW over the model's flat parameter buffer, and the learning-rate schedule (docs/training.md).

One call of the registered `adamw` op computes the global gradient norm, clips, and updates every
parameter; weight decay covers the matrices, which the model lays out first ([0, n_decay)).

Data parallelism enters through a `Collectives` object (nanoeuler_core.collectives; the backend
makes them); the engine knows only this interface. Between the backward and the update, AdamW sums the
gradient buffer over the ranks (all-reduce), or, with sharded optimizer state (ZeRO-1), sums each
rank's slice of it (reduce-scatter), updates that slice with its share of the moments and clips by
the global norm, then gathers the updated slices (all-gather). The calls on backend arrays are
backend work, so a captured CUDA graph holds them.

The sums start before the backward ends, as PyTorch's DDP does: the backward of a step's last
micro-batch reports each group of parameters whose gradient is final (`GradientSync.ready`), and
every contiguous run of final gradients of at least `bucket` elements is summed at once, on the
communication stream, while the backward goes on (ZeRO-1: reduced to the rank that owns each
part); `update` waits for the last of them. A step on N ranks then costs about what it costs on one.
"""

from __future__ import annotations

import math

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.collectives import Collectives, shard


SCHEDULES = ("cosine", "wsd")
WSD_DECAY_FRACTION = 0.2   # warmup-stable-decay: the share of the steps after warm-up spent decaying


def lr_at(step: int, peak: float, warmup: int, total: int, final_ratio: float = 0.1, schedule: str = "cosine") -> float:
    """Linear warm-up over `warmup` steps, then down to `final_ratio * peak` at `total` (1-based step):
    "cosine" decays along a half cosine from the warm-up on; "wsd" (warmup-stable-decay) holds the
    peak, then decays linearly over the last WSD_DECAY_FRACTION of the steps after warm-up."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "wsd":
        decayed = max(0.0, progress - (1 - WSD_DECAY_FRACTION)) / WSD_DECAY_FRACTION
        return peak * (1 - (1 - final_ratio) * decayed)
    return peak * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


BUCKET_ELEMENTS = 4 * 2**20   # gradients summed per collective at least (16 MB of float32; DDP's are 25 MB)


class GradientSync:
    """Sums the model's gradient buffer over the ranks in buckets while the backward still runs.

    `ready(names)` marks parameters whose gradients are final; each contiguous run of final,
    not yet summed gradients of at least `bucket` elements is summed (all-reduced, or with ZeRO-1
    reduced onto the rank owning each part of it) as soon as it forms; `finish()` sums what is
    left and waits. The runs depend only on the order of `ready` calls, the same on every rank.
    """

    def __init__(self, model, comm: Collectives, zero: bool, bucket: int = BUCKET_ELEMENTS):
        self.model, self.comm, self.zero, self.bucket = model, comm, zero, bucket
        self.started = False
        self._ready: list[list[int]] = []    # sorted, disjoint [lo, hi) runs of final, unsummed gradients
        self._summed = 0

    def begin(self) -> None:
        self.started, self._ready, self._summed = True, [], 0

    def ready(self, names) -> None:
        """The gradients of these parameters are final: sum every run that is now large enough."""
        for name in names:
            offset, shape = self.model.layout[name]
            self._add(offset, offset + int(np.prod(shape)))
        for run in [r for r in self._ready if r[1] - r[0] >= self.bucket]:
            self._ready.remove(run)
            self._sum(*run)

    def finish(self) -> None:
        """Sum the rest and wait for every sum; every parameter must have been reported."""
        for run in self._ready:
            self._sum(*run)
        if self._summed != self.model.n_params:
            raise RuntimeError(f"the backward reported {self._summed:,} of {self.model.n_params:,} gradients final")
        self.comm.wait()
        self.started = False

    def _add(self, lo: int, hi: int) -> None:
        runs = self._ready + [[lo, hi]]
        runs.sort()
        merged = [runs[0]]
        for run in runs[1:]:
            if run[0] == merged[-1][1]:
                merged[-1] = [merged[-1][0], run[1]]
            else:
                merged.append(run)
        self._ready = merged

    def _sum(self, lo: int, hi: int) -> None:
        grads, comm = self.model.grad_flat, self.comm
        self._summed += hi - lo
        if not self.zero:
            comm.all_reduce_sum_async(grads[lo:hi])
            return
        per_rank = self.model.n_params // comm.size
        while lo < hi:   # split where the ranks' shards meet: each part goes to its owner
            owner = lo // per_rank
            end = min(hi, (owner + 1) * per_rank)
            comm.reduce_sum_async(grads[lo:end], owner)
            lo = end


class AdamW:
    """AdamW with global gradient-norm clipping; with `comm`, data-parallel over its ranks, and with
    `zero`, each rank keeps the moments of its shard of the parameters only (ZeRO-1). `overlap`
    starts the gradients' sums during the backward (see GradientSync)."""

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: bool = False, overlap: bool = True):
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
        self._adamw = registry.kernels_on(model.backend_name, ["adamw"]).adamw.forward
        self.sync = GradientSync(model, comm, zero) if comm is not None and overlap else None

    def grads_ready_hook(self):
        """What the backward of a step's last micro-batch should call as gradients become final
        (Model.forward_backward's `grads_ready`), or None where nothing overlaps: the sums over
        the ranks then start early, and `update` waits for them."""
        if self.sync is None:
            return None
        self.sync.begin()
        return self.sync.ready

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
        synced = self.sync is not None and self.sync.started
        if synced:
            self.sync.finish()
        if not self.zero:
            if comm is not None and not synced:
                comm.all_reduce_sum(model.grad_flat)
            norm, _ = self._adamw(model.flat, model.grad_flat, self.m, self.v, self.sched, n_decay=model.n_decay,
                                  **hyper)
            model.refresh_compute_weights()
            return norm
        if not synced:
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
