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
group is sharded with ZeRO-1 and ZeRO-2 (`zero`); a Muon group is always sharded over the ranks, a whole
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

ZeRO-2 (`zero=2`) keeps the gradients whole only bucket by bucket: the model's backward writes
them into a few slots of memory that the buckets take in turn, every micro-batch's backward
reports, and each bucket's sum is reduced onto the ranks owning its parts, which add it into
their shard of the gradients; the flat gradient buffer is freed (`GradientSync`).

The update itself cannot start on a bucket as soon as its sum lands: every update scales its
gradient by min(1, max_grad_norm / norm), the norm of the group's whole gradient (for AdamW, of
every parameter), which is known only once the last bucket's sum has landed. What is left after it
is the norm and the update over this rank's part (a 1 / ranks share with ZeRO-1 and ZeRO-2).
"""

from __future__ import annotations

import bisect
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
    grad: object = None       # the summed gradients of [own_lo, own_hi): a view of the model's buffer, or a shard (ZeRO-2)


@dataclass
class Bucket:
    """Gradients summed together: those of the backward's reports `reports` (indices into
    Model.gradient_reports()), the layout's runs `runs` (sorted, disjoint [lo, hi)); with ZeRO-2
    they live in slot `slot` of the buckets' memory, the runs one after another."""

    reports: list[int]
    runs: list[tuple[int, int]]
    slot: int = -1

    @property
    def size(self) -> int:
        return sum(hi - lo for lo, hi in self.runs)


def plan_buckets(model, bucket: int, heads_together: bool = False) -> list[Bucket]:
    """The buckets of one backward, in the order they fire: the final gradients not yet summed
    form a bucket as soon as they hold `bucket` elements, or, once what is still to come fits in
    one bucket, at every report. With `heads_together` the reports holding heads join the last of
    them: the classifier adds every head's gradient into one (K V, C) view, which must lie in one
    bucket's memory (ZeRO-2), and a tied tok_emb's from the backward's start."""
    reports = model.gradient_reports()
    units = [[j] for j in range(len(reports))]   # the reports, each joined to the one it fires with
    if heads_together:
        holding = [j for j, names in enumerate(reports) if set(names) & set(model.cfg.head_names())]
        for j in holding[:-1]:
            units[holding[-1]] += units[j]
            units[j] = []
    ranges = [[(model.layout[n][0], model.layout[n][0] + int(np.prod(model.layout[n][1]))) for n in names]
              for names in reports]
    buckets, current, pending, summed = [], [], 0, 0
    for unit in filter(None, units):
        current += unit
        pending += sum(hi - lo for j in unit for lo, hi in ranges[j])
        if pending >= bucket or model.n_params - summed - pending <= bucket:
            runs: list[list[int]] = []
            for lo, hi in sorted(r for j in current for r in ranges[j]):
                if runs and runs[-1][1] == lo:
                    runs[-1][1] = hi
                else:
                    runs.append([lo, hi])
            buckets.append(Bucket(sorted(current), [(lo, hi) for lo, hi in runs]))
            summed, current, pending = summed + pending, [], 0
    return buckets


def assign_slots(buckets: list[Bucket], n_reports: int) -> list[int]:
    """Give each bucket a slot of memory (`Bucket.slot`) from the moment the backward starts writing
    its gradients (after the report before its first; report 0's from the start) until it fires,
    reusing the slot a bucket released longest ago, never the one released at the same report (its
    sums are still running); returns each slot's size in elements."""
    sizes: list[int] = []
    released: list[tuple[int, int]] = []   # (event, slot), oldest first
    for event in range(n_reports + 1):     # event 0: the start; event j + 1: report j
        for b in buckets:
            if event and max(b.reports) == event - 1:
                released.append((event, b.slot))
        for b in buckets:
            if min(b.reports) == event:
                free = next((k for k, (when, _) in enumerate(released) if when < event), None)
                if free is None:
                    b.slot = len(sizes)
                    sizes.append(0)
                else:
                    b.slot = released.pop(free)[1]
                sizes[b.slot] = max(sizes[b.slot], b.size)
    return sizes


class BucketMemory:
    """ZeRO-2's gradients (or their bf16 copies): each bucket's runs one after another in its
    slot's memory. Sliced as the flat buffer would be ([lo:hi] of the layout, within one run), it
    gives the view where those gradients live."""

    def __init__(self, backend, buckets: list[Bucket], slot_sizes: list[int], dtype=None):
        self.slots = [backend.zeros(n, dtype) for n in slot_sizes]
        self._runs = []   # (lo, hi, slot, position in the slot), by lo
        for b in buckets:
            position = 0
            for lo, hi in b.runs:
                self._runs.append((lo, hi, b.slot, position))
                position += hi - lo
        self._runs.sort()
        self._starts = [run[0] for run in self._runs]

    @property
    def elements(self) -> int:
        return sum(slot.size for slot in self.slots)

    def __getitem__(self, s: slice):
        lo, hi, slot, position = self._runs[bisect.bisect_right(self._starts, s.start) - 1]
        if not lo <= s.start <= s.stop <= hi:
            raise ValueError(f"gradients [{s.start}, {s.stop}) lie in two buckets' memory")
        return self.slots[slot][position + s.start - lo:position + s.stop - lo]


class GradientSync:
    """Sums the model's gradients over the ranks in buckets while the backward still runs.

    The backward reports the gradients it has finished (`ready`, Model.gradient_reports() in
    turn); a bucket fires (each of its runs summed: all-reduced, or, inside a sharded group,
    reduced onto the rank owning each part of it) once every report it holds has come
    (`plan_buckets`): so the last bucket, which nothing can overlap, holds only what the last
    report brings (the embedding table and the first norm), and the small gradients (the norms)
    ride with the next large bucket instead of waiting for the end. `finish()` marks the end of
    the backward (`Collectives.backward_done`: the exposed communication is timed from there),
    checks that every bucket fired and waits. The buckets depend only on the model, the same on
    every rank.

    With `shards` (ZeRO-2) each bucket's gradients live in a slot of memory reused from bucket
    to bucket (`assign_slots`, `BucketMemory`), not in the model's flat buffer, which is freed:
    a slot is handed out, once the sums that read it last are done and zeroed, when the backward
    starts on the bucket's gradients, and each part of a bucket's sum is added into its owner's
    shard (`Group.grad`). Every backward of a step reports, each adding into the shards.
    With `bf16`, every sum travels in bfloat16 through a bf16 copy (of the buffer, or of the slots).
    """

    def __init__(self, model, comm: Collectives, groups: list[Group], bucket: int = BUCKET_ELEMENTS,
                 bf16: bool = False, shards: bool = False):
        self.model, self.comm, self.groups, self.shards = model, comm, groups, shards
        self.reports = model.gradient_reports()
        self.n_reports = len(self.reports)
        self.buckets = plan_buckets(model, bucket, heads_together=shards)
        if shards:
            sizes = assign_slots(self.buckets, self.n_reports)
            self.grads = BucketMemory(model.backend, self.buckets, sizes)
            self.wire = BucketMemory(model.backend, self.buckets, sizes, "bf16") if bf16 else None
            model.gradients_in(self.grads, flat=False)
        else:
            self.grads = model.grad_flat
            self.wire = model.backend.zeros(model.n_params, "bf16") if bf16 else None
        self.started = False
        self._reported = self._fired = self._summed = 0
        self._markers: dict[int, object] = {}   # slot -> the marker recorded after its last sums
        self._in_flight: set[int] = set()        # slots whose sums may still run

    @property
    def wire_elements(self) -> int:
        """The size of the bf16 copy the sums travel in (0 for float32 sums)."""
        return 0 if self.wire is None else self.wire.elements if self.shards else self.model.n_params

    def begin(self) -> None:
        """A backward starts reporting."""
        if self.started and self._fired < len(self.buckets):
            raise RuntimeError(f"a backward reported {self._reported} of its {self.n_reports} reports")
        self.started, self._reported, self._fired = True, 0, 0
        self._open(0)

    def ready(self, names) -> None:
        """The gradients of these parameters (the backward's next report) are final: fire every
        bucket they complete."""
        j = self._reported
        if j >= self.n_reports or list(names) != self.reports[j]:
            raise RuntimeError(f"report {j} of the backward names {list(names)}, not {self.reports[j:j + 1]}")
        self._reported += 1
        while self._fired < len(self.buckets) and max(self.buckets[self._fired].reports) <= j:
            self._fire(self.buckets[self._fired])
            self._fired += 1
        self._open(j + 1)

    def finish(self) -> None:
        """The backward has ended: wait for every sum; every parameter must have been reported."""
        self.comm.backward_done()
        if self._fired != len(self.buckets):
            summed = sum(b.size for b in self.buckets[:self._fired])
            raise RuntimeError(f"the backward reported {summed:,} of {self.model.n_params:,} gradients final")
        self.comm.wait()
        self.started, self._in_flight = False, set()

    def sum_all(self) -> None:
        """Sum the whole buffer at once, after the backward (no overlap)."""
        self.comm.backward_done()
        self._sum(0, self.model.n_params)
        self.comm.wait()

    def _open(self, event: int) -> None:
        """ZeRO-2: hand out the slots of the buckets whose gradients the backward writes from now
        on (event 0: the start; event j + 1: after report j), zeroed once their last sums are done."""
        if not self.shards:
            return
        for b in self.buckets:
            if min(b.reports) == event:
                if b.slot in self._in_flight:
                    self.comm.wait_for(self._markers[b.slot])
                self.model.backend.zero_(self.grads.slots[b.slot][:b.size])

    def _fire(self, bucket: Bucket) -> None:
        for lo, hi in bucket.runs:
            self._sum(lo, hi)
        if self.shards:
            self._markers[bucket.slot] = self.comm.mark(self._markers.get(bucket.slot))
            self._in_flight.add(bucket.slot)

    def _sum(self, lo: int, hi: int) -> None:
        grads, comm = self.grads, self.comm
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
                into = {"into": group.grad[start - group.own_lo:stop - group.own_lo]} \
                    if self.shards and owner == comm.rank else {}
                comm.reduce_sum_async(grads[start:stop], owner, **self._wire(start, stop), **into)
                start = stop

    def _wire(self, lo: int, hi: int) -> dict:
        return {} if self.wire is None else {"wire": self.wire[lo:hi]}


class Optimizer:
    """One step over the model's buffer, group by group (see the module docstring); with `comm`,
    data-parallel over its ranks; `overlap` starts the gradients' sums during the backward
    (GradientSync); `zero` 2 keeps only this rank's shard of the summed gradients. Subclasses
    choose the groups."""

    name = ""

    def __init__(self, model, groups: list[Group], comm: Collectives | None, overlap: bool, grad_reduce: str,
                 zero: int = 0):
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}, got '{grad_reduce}'")
        if zero == 2 and not overlap:
            raise ValueError("ZeRO-2 sums each bucket as the backward finishes it: it cannot sum after the backward")
        self.model, self.groups, self.comm, self.overlap, self.zero = model, groups, comm, overlap, zero
        kernels = registry.kernels_on(model.backend_name, sorted({g.op for g in groups}))
        for group in groups:
            group.kernel = getattr(kernels, group.op).forward
            group.sched = model.backend.zeros(2)
            group.grad = model.backend.zeros(group.own_hi - group.own_lo) if zero == 2 else \
                model.grad_flat[group.own_lo:group.own_hi]
        self.step_count = 0
        self.sync = GradientSync(model, comm, groups, bf16=grad_reduce == "bf16", shards=zero == 2) \
            if comm is not None else None

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
        gradients = " and gradients" if self.zero == 2 else ""
        return f"{' and '.join(names)} state{gradients} sharded" if names else ""

    @property
    def sums_in_bf16(self) -> bool:
        return self.sync is not None and self.sync.wire is not None

    @property
    def state_elements(self) -> int:
        """The optimizer state this rank holds, in elements."""
        return sum(len(g.state) * (g.own_hi - g.own_lo) for g in self.groups)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: the parameters (the master weights, and their bf16 copy in mixed
        precision), the gradients (the flat buffer; with ZeRO-2 the buckets' slots and this rank's
        shards), the optimizer state (this rank's part where sharded) and the bf16 copy of the
        gradients the sums travel in."""
        model, item = self.model, np.dtype(self.model.backend.dtype).itemsize
        copy = 2 * model.n_params if model.compute_flat is not model.flat else 0
        grads = model.n_params if self.zero != 2 else \
            self.sync.grads.elements + sum(g.own_hi - g.own_lo for g in self.groups)
        return {"parameters": model.n_params * item + copy, "gradients": grads * item,
                "optimizer_state": self.state_elements * item,
                "bf16_sums": 0 if self.sync is None else 2 * self.sync.wire_elements}

    def grads_ready_hook(self, final: bool = True):
        """What the backward of a micro-batch should call as gradients become final
        (Model.forward_backward's `grads_ready`; `final`: the step's last micro-batch), or None
        where nothing overlaps: the sums over the ranks then start early, and `update` waits for
        them. With ZeRO-2 every micro-batch's backward reports: its sums add into the shards."""
        if self.sync is None or not self.overlap or not (final or self.zero == 2):
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
        elif self.zero == 2:
            raise RuntimeError("ZeRO-2 sums the gradients as the backward reports them: no backward reported any")
        elif self.sums_in_bf16:
            self.sync.sum_all()
        elif comm is not None:   # after the backward, one collective per group, on the kernels' stream
            comm.backward_done()
            for g in self.groups:
                (comm.reduce_scatter_sum if g.sharded else comm.all_reduce_sum)(model.grad_flat[g.lo:g.hi])
            comm.wait()
        norms = []
        for g in self.groups:
            norm, _ = g.kernel(model.flat[g.own_lo:g.own_hi], g.grad, *g.state.values(),
                               g.sched, reduce_sum_squares=comm.all_reduce_sum if g.sharded else None, **g.attrs)
            norms.append(norm)
        for g in self.groups:
            if g.sharded:
                comm.all_gather(model.flat[g.lo:g.hi])
            if self.zero == 2:   # the next step's backwards add into it
                model.backend.zero_(g.grad)
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


ZERO = (0, 1, 2)   # what the ranks shard: nothing; the AdamW moments (ZeRO-1); the summed gradients too (ZeRO-2)


def _adamw_group(model, lo: int, hi: int, comm, zero: int, betas, eps, weight_decay, max_grad_norm) -> Group:
    if zero and (hi - lo) % comm.size:
        raise ValueError(f"--zero {zero} splits the {hi - lo:,} parameters AdamW updates evenly over the ranks: "
                         f"{comm.size} ranks do not divide them; use a rank count that does, or no --zero")
    group = Optimizer._group(model, "adamw", lo, hi, comm, bool(zero), ("m", "v"),
                             dict(beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                                  max_grad_norm=max_grad_norm))
    group.attrs["n_decay"] = min(max(model.n_decay - group.own_lo, 0), group.own_hi - group.own_lo)
    return group


def _check_zero(comm, zero: int) -> None:
    if zero not in ZERO:
        raise ValueError(f"--zero must be 0 (off), 1 (sharded optimizer state) or 2 (and sharded gradients), got {zero}")
    if zero and comm is None:
        raise ValueError(f"sharded optimizer state (--zero {zero}) needs data-parallel ranks (mpiexec)")


class AdamW(Optimizer):
    """AdamW over the whole buffer, with global gradient-norm clipping; with `zero` 1, each rank
    keeps the moments of its shard of the parameters only (ZeRO-1); with 2, also only its shard of
    the summed gradients (ZeRO-2)."""

    name = "adamw"

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: int = 0, overlap: bool = True, grad_reduce: str = "fp32"):
        _check_zero(comm, zero)
        group = _adamw_group(model, 0, model.n_params, comm, zero, betas, eps, weight_decay, max_grad_norm)
        super().__init__(model, [group], comm, overlap, grad_reduce, zero)


class Muon(Optimizer):
    """Muon over the blocks' matrices (momentum orthogonalized by a Newton-Schulz iteration: the
    `muon` op), AdamW over the embedding table, the heads and the norms; each group clipped by its
    own gradient norm. With ranks, each updates the matrices of a whole number of blocks (when they
    divide the blocks) and keeps their momentum alone; `zero` shards the AdamW group too, and with
    2 the gradients of both groups (the ranks must then divide the blocks).
    `lr_ratio` is the Muon group's learning rate as a multiple of the schedule's (AdamW's)."""

    name = "muon"

    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
                 comm: Collectives | None = None, zero: int = 0, overlap: bool = True, grad_reduce: str = "fp32",
                 momentum: float = 0.95, ns_steps: int = 5, lr_ratio: float = 1.0):
        _check_zero(comm, zero)
        blocks = model.cfg.n_layers
        shared_out = comm is not None and blocks % comm.size == 0
        if zero == 2 and not shared_out:
            raise ValueError(f"--zero 2 --optimizer muon shares out the gradients of whole blocks: {comm.size} ranks "
                             f"do not divide the {blocks} blocks; use a rank count that does, or --zero 1")
        muon = self._group(model, "muon", 0, model.n_hidden, comm, shared_out, ("momentum",),
                           dict(pattern=model.block_matrices, repeats=blocks // (comm.size if shared_out else 1),
                                beta=momentum, nesterov=True, ns_steps=ns_steps, weight_decay=weight_decay,
                                max_grad_norm=max_grad_norm))
        muon.lr_ratio = lr_ratio
        rest = _adamw_group(model, model.n_hidden, model.n_params, comm, zero, betas, eps, weight_decay, max_grad_norm)
        super().__init__(model, [muon, rest], comm, overlap, grad_reduce, zero)


def make_optimizer(name: str, model, **settings) -> Optimizer:
    """The optimizer called `name` (OPTIMIZERS) over `model`, with AdamW's settings (betas, eps,
    weight_decay, max_grad_norm) and the data-parallel ones (comm, zero, overlap, grad_reduce)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{name}'")
    return (AdamW if name == "adamw" else Muon)(model, **settings)
