"""The optimizers over the model's flat parameter buffer, and the learning-rate schedule
(docs/training.md).

An optimizer splits the buffer into groups, each a contiguous range [lo, hi) that one registered
optimizer op updates in one call, clipping by the group's gradient norm:
  - `AdamW`: one `adamw` group over the whole buffer; weight decay covers the matrices, which the
    model lays out first ([0, n_decay)).
  - `Muon`: a `muon` group over the blocks' matrices (the prefix [0, n_hidden), one block's
    matrices after another: the op batches the same matrix of every block), and an `adamw` group
    over the rest (embedding table, heads, norms).

Data parallelism enters through a `Collectives` object (nanoeuler_core.collectives; the backend
makes them); the engine knows only this interface. Between the backward and the update, each
group's gradients are summed over the ranks: all-reduced, or, for a sharded group, each rank's
part is summed onto it (reduce-scatter), the rank updates that part with its share of the state
and clips by the group's global norm, and the updated parts are gathered (all-gather). An AdamW
group is sharded with ZeRO-1 (`zero`); a Muon group is always sharded over the ranks, a whole
number of blocks each, so its orthogonalization is shared out. The calls on backend arrays are
backend work, so a captured CUDA graph holds them.

The sums start before the backward ends, as PyTorch's DDP does: the backward of a step's last
micro-batch reports each group of parameters whose gradient is final (`GradientSync.ready`), and
the final gradients are summed in buckets, in the order the backward finishes them, on the
communication stream, while the backward goes on (ZeRO-1: reduced to the rank that owns each part);
`update` waits for the last of them. The last bucket holds only the embedding table and the first
norm (what the backward finishes last), so little communication is left once the backward ends.
With `grad_reduce="bf16"` the sums travel in bfloat16 (half the bytes) and land in the float32
gradient buffer, which the update reads.

The update itself cannot start on a bucket as soon as its sum lands: every update scales its
gradient by min(1, max_grad_norm / norm), the norm of the group's whole gradient (for AdamW, of
every parameter), which is known only once the last bucket's sum has landed. What is left after it
is the norm and the update over this rank's part (a 1 / ranks share with ZeRO-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
OPTIMIZERS = ("adamw", "muon")
GRAD_REDUCE = ("fp32", "bf16")   # what the gradients' sums over the ranks travel in


@dataclass
class Group:
    """The parameters [lo, hi) that one optimizer op updates. A sharded group's rank updates only
    its part [own_lo, own_hi), with state for that part alone; the parts are gathered after."""

    op: str
    lo: int
    hi: int
    sharded: bool
    own_lo: int
    own_hi: int
    state: dict = field(default_factory=dict)   # name -> backend array over [own_lo, own_hi), in the op's order
    attrs: dict = field(default_factory=dict)
    lr_ratio: float = 1.0     # the group's learning rate as a multiple of the schedule's
    sched: object = None      # [lr * lr_ratio, step] on the backend: a captured step reads them from here
    kernel: object = None


class GradientSync:
    """Sums the model's gradient buffer over the ranks in buckets while the backward still runs.

    `ready(names)` marks parameters whose gradients are final, in the order the backward produces
    them. A bucket is every final gradient not yet summed; it fires (each of its contiguous runs
    summed: all-reduced, or, inside a sharded group, reduced onto the rank owning each part of it)
    as soon as it holds `bucket` elements, or, once what is still to come fits in one bucket, at
    every report: so the last bucket, which nothing can overlap, holds only what the last report
    brings (the embedding table and the first norm), and the small gradients (the norms) ride with
    the next large bucket instead of waiting for the end. `finish()` marks the end of the backward
    (`Collectives.backward_done`: the exposed communication is timed from there), sums what is
    left and waits. The buckets depend only on the order of `ready` calls, the same on every rank.

    With `wire` (a bf16 buffer as long as the gradients), every sum travels in bfloat16.
    """

    def __init__(self, model, comm: Collectives, groups: list[Group], bucket: int = BUCKET_ELEMENTS, wire=None):
        self.model, self.comm, self.groups, self.bucket, self.wire = model, comm, groups, bucket, wire
        self.started = False
        self._ready: list[list[int]] = []    # sorted, disjoint [lo, hi) runs of final, unsummed gradients
        self._pending = 0                    # elements in them
        self._summed = 0

    def begin(self) -> None:
        self.started, self._ready, self._pending, self._summed = True, [], 0, 0

    def ready(self, names) -> None:
        """The gradients of these parameters are final: fire the bucket if it is due."""
        for name in names:
            offset, shape = self.model.layout[name]
            self._add(offset, offset + int(np.prod(shape)))
        to_come = self.model.n_params - self._summed - self._pending
        if self._pending >= self.bucket or to_come <= self.bucket:
            self._fire()

    def finish(self) -> None:
        """The backward has ended: sum the rest and wait for every sum; every parameter must have
        been reported."""
        self.comm.backward_done()
        self._fire()
        if self._summed != self.model.n_params:
            raise RuntimeError(f"the backward reported {self._summed:,} of {self.model.n_params:,} gradients final")
        self.comm.wait()
        self.started = False

    def sum_all(self) -> None:
        """Sum the whole buffer at once, after the backward (no overlap)."""
        self.begin()
        self._add(0, self.model.n_params)
        self.finish()

    def _add(self, lo: int, hi: int) -> None:
        self._pending += hi - lo
        runs = self._ready + [[lo, hi]]
        runs.sort()
        merged = [runs[0]]
        for run in runs[1:]:
            if run[0] == merged[-1][1]:
                merged[-1] = [merged[-1][0], run[1]]
            else:
                merged.append(run)
        self._ready = merged

    def _fire(self) -> None:
        for run in self._ready:
            self._sum(*run)
        self._ready, self._pending = [], 0

    def _sum(self, lo: int, hi: int) -> None:
        grads, comm = self.model.grad_flat, self.comm
        self._summed += hi - lo
        for group in self.groups:
            start, end = max(lo, group.lo), min(hi, group.hi)
            if start >= end:
                continue
            if not group.sharded:
                comm.all_reduce_sum_async(grads[start:end], **self._wire(start, end))
                continue
            per_rank = (group.hi - group.lo) // comm.size
            while start < end:   # split where the ranks' parts meet: each part goes to its owner
                owner = (start - group.lo) // per_rank
                stop = min(end, group.lo + (owner + 1) * per_rank)
                comm.reduce_sum_async(grads[start:stop], owner, **self._wire(start, stop))
                start = stop

    def _wire(self, lo: int, hi: int) -> dict:
        return {} if self.wire is None else {"wire": self.wire[lo:hi]}


class Optimizer:
    """One step over the model's buffer, group by group (see the module docstring); with `comm`,
    data-parallel over its ranks; `overlap` starts the gradients' sums during the backward
    (GradientSync). Subclasses choose the groups."""

    name = ""

    def __init__(self, model, groups: list[Group], comm: Collectives | None, overlap: bool, grad_reduce: str):
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}, got '{grad_reduce}'")
        self.model, self.groups, self.comm, self.overlap = model, groups, comm, overlap
        kernels = registry.kernels_on(model.backend_name, sorted({g.op for g in groups}))
        for group in groups:
            group.kernel = getattr(kernels, group.op).forward
            group.sched = model.backend.zeros(2)
        self.step_count = 0
        # the bf16 copy of the gradients the sums travel in
        self.wire = model.backend.zeros(model.n_params, "bf16") if comm is not None and grad_reduce == "bf16" else None
        self.sync = GradientSync(model, comm, groups, wire=self.wire) if comm is not None else None

    @staticmethod
    def _group(model, op: str, lo: int, hi: int, comm, sharded: bool, state: tuple[str, ...], attrs: dict) -> Group:
        own_lo, own_hi = lo, hi
        if sharded:
            part_lo, part_hi = shard(hi - lo, comm.rank, comm.size)
            own_lo, own_hi = lo + part_lo, lo + part_hi
        return Group(op, lo, hi, sharded, own_lo, own_hi, {s: model.backend.zeros(own_hi - own_lo) for s in state},
                     attrs)

    @property
    def sharded(self) -> str:
        """Which groups' state the ranks share out, in words ("" for none)."""
        names = [{"adamw": "AdamW", "muon": "Muon"}[g.op] for g in self.groups if g.sharded]
        return f"{' and '.join(names)} state sharded" if names else ""

    @property
    def state_elements(self) -> int:
        """The optimizer state this rank holds, in elements."""
        return sum(len(g.state) * (g.own_hi - g.own_lo) for g in self.groups)

    @property
    def wire_bytes(self) -> int:
        """The bytes of the bf16 buffer the gradients' sums travel in (0 for float32 sums)."""
        return 0 if self.wire is None else 2 * self.model.n_params

    def grads_ready_hook(self):
        """What the backward of a step's last micro-batch should call as gradients become final
        (Model.forward_backward's `grads_ready`), or None where nothing overlaps: the sums over
        the ranks then start early, and `update` waits for them."""
        if self.sync is None or not self.overlap:
            return None
        self.sync.begin()
        return self.sync.ready

    def set_schedule(self, lr: float) -> None:
        """Start the next step at learning rate `lr` (host work: call before `update`)."""
        self.step_count += 1
        for g in self.groups:
            self.model.backend.copy_(g.sched, np.array([lr * g.lr_ratio, self.step_count], dtype=self.model.backend.dtype))

    def update(self) -> list:
        """Sum each group's gradients over the ranks, clip and apply them to the master weights,
        gather the sharded parts, then refresh the copy the model computes with (backend work
        only); returns each group's gradient norm (1,) on the backend (see `host_norm`)."""
        model, comm = self.model, self.comm
        if self.sync is not None and self.sync.started:
            self.sync.finish()
        elif self.wire is not None:
            self.sync.sum_all()
        elif comm is not None:   # after the backward, one collective per group, on the kernels' stream
            comm.backward_done()
            for g in self.groups:
                (comm.reduce_scatter_sum if g.sharded else comm.all_reduce_sum)(model.grad_flat[g.lo:g.hi])
            comm.wait()
        norms = []
        for g in self.groups:
            norm, _ = g.kernel(model.flat[g.own_lo:g.own_hi], model.grad_flat[g.own_lo:g.own_hi], *g.state.values(),
                               g.sched, reduce_sum_squares=comm.all_reduce_sum if g.sharded else None, **g.attrs)
            norms.append(norm)
        for g in self.groups:
            if g.sharded:
                comm.all_gather(model.flat[g.lo:g.hi])
        model.refresh_compute_weights()
        return norms

    def host_norm(self, norms) -> float:
        """The gradient norm before clipping, over every group, from `update`'s norms."""
        return math.sqrt(sum(float(self.model.backend.to_host(n)[0]) ** 2 for n in norms))

    def step(self, lr: float) -> float:
        """Apply one update from the model's gradient buffer; returns the gradient norm before clipping."""
        self.set_schedule(lr)
        return self.host_norm(self.update())

    def reset(self) -> None:
        """Back to step 0 with zero state, in place (a captured step keeps reading the same arrays)."""
        for g in self.groups:
            for array in g.state.values():
                self.model.backend.copy_(array, np.zeros(g.own_hi - g.own_lo, dtype=self.model.backend.dtype))
        self.step_count = 0

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The state as named tensors (`<state>.<parameter>`: m and v for AdamW, momentum for
        Muon), the step and the optimizer's name, for optimizer.safetensors. Every rank must call
        it (sharded state is gathered)."""
        be, tensors = self.model.backend, {}
        for g in self.groups:
            for key, array in g.state.items():
                full = self.comm.host_concat(be.to_host(array)) if g.sharded else be.to_host(array)
                for name, (offset, shape) in self._names(g):
                    tensors[f"{key}.{name}"] = full[offset - g.lo:offset - g.lo + int(np.prod(shape))].reshape(shape)
        return tensors, {"step": str(self.step_count), "optimizer": self.name}

    def load_state(self, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        saved = metadata.get("optimizer", "adamw")
        if saved != self.name:
            raise ValueError(f"the optimizer state is {saved}'s, not {self.name}'s: resume with --optimizer {saved}")
        be = self.model.backend
        for g in self.groups:
            for key, array in g.state.items():
                full = np.empty(g.hi - g.lo, dtype=be.dtype)
                for name, (offset, shape) in self._names(g):
                    if f"{key}.{name}" not in tensors or tensors[f"{key}.{name}"].shape != shape:
                        raise ValueError(f"optimizer state lacks '{key}.{name}' of shape {shape}")
                    full[offset - g.lo:offset - g.lo + int(np.prod(shape))] = tensors[f"{key}.{name}"].reshape(-1)
                be.copy_(array, full[g.own_lo - g.lo:g.own_hi - g.lo])
        self.step_count = int(metadata.get("step", 0))

    def _names(self, g: Group):
        return [(name, (offset, shape)) for name, (offset, shape) in self.model.layout.items() if g.lo <= offset < g.hi]


def _adamw_group(model, lo: int, hi: int, comm, zero: bool, betas, eps, weight_decay, max_grad_norm) -> Group:
    if zero and (hi - lo) % comm.size:
        raise ValueError(f"--zero 1 splits the {hi - lo:,} parameters AdamW updates evenly over the ranks: "
                         f"{comm.size} ranks do not divide them; use a rank count that does, or no --zero")
    group = Optimizer._group(model, "adamw", lo, hi, comm, zero, ("m", "v"),
                             dict(beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                                  max_grad_norm=max_grad_norm))
    group.attrs["n_decay"] = min(max(model.n_decay - group.own_lo, 0), group.own_hi - group.own_lo)
    return group


def _check_zero(comm, zero: bool) -> None:
    if zero and comm is None:
        raise ValueError("sharded optimizer state (--zero 1) needs data-parallel ranks (mpiexec)")


class AdamW(Optimizer):
    """AdamW over the whole buffer, with global gradient-norm clipping; with `zero`, each rank
    keeps the moments of its shard of the parameters only (ZeRO-1)."""

    name = "adamw"

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: bool = False, overlap: bool = True, grad_reduce: str = "fp32"):
        _check_zero(comm, zero)
        group = _adamw_group(model, 0, model.n_params, comm, zero, betas, eps, weight_decay, max_grad_norm)
        super().__init__(model, [group], comm, overlap, grad_reduce)


class Muon(Optimizer):
    """Muon over the blocks' matrices (momentum orthogonalized by a Newton-Schulz iteration: the
    `muon` op), AdamW over the embedding table, the heads and the norms; each group clipped by its
    own gradient norm. With ranks, each updates the matrices of a whole number of blocks (when they
    divide the blocks) and keeps their momentum alone; `zero` shards the AdamW group too.
    `lr_ratio` is the Muon group's learning rate as a multiple of the schedule's (AdamW's)."""

    name = "muon"

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: bool = False, overlap: bool = True, grad_reduce: str = "fp32",
                 momentum: float = 0.95, ns_steps: int = 5, lr_ratio: float = 1.0):
        _check_zero(comm, zero)
        blocks = model.cfg.n_layers
        shared_out = comm is not None and blocks % comm.size == 0
        muon = self._group(model, "muon", 0, model.n_hidden, comm, shared_out, ("momentum",),
                           dict(pattern=model.block_matrices, repeats=blocks // (comm.size if shared_out else 1),
                                beta=momentum, nesterov=True, ns_steps=ns_steps, weight_decay=weight_decay,
                                max_grad_norm=max_grad_norm))
        muon.lr_ratio = lr_ratio
        rest = _adamw_group(model, model.n_hidden, model.n_params, comm, zero, betas, eps, weight_decay, max_grad_norm)
        super().__init__(model, [muon, rest], comm, overlap, grad_reduce)


def make_optimizer(name: str, model, **settings) -> Optimizer:
    """The optimizer called `name` (OPTIMIZERS) over `model`, with AdamW's settings (betas, eps,
    weight_decay, max_grad_norm) and the data-parallel ones (comm, zero, overlap, grad_reduce)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{name}'")
    return (AdamW if name == "adamw" else Muon)(model, **settings)
