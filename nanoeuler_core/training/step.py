"""One training step, captured: the forward and backward of each micro-batch (Model.prepare and
Model.forward_backward), the gradients summed in the model's buffer and over the optimizer's
ranks, clipping and the optimizer update, replayed as one CUDA graph per batch shape on a GPU."""

from __future__ import annotations

import numpy as np

from nanoeuler_core.engine.optim import Optimizer, make_optimizer


class TrainStep:
    """One optimisation step on micro-batches of one shape.

    The micro-batches are copied into backend buffers that stay put (the `Batch`es of the first
    step of each shape, refilled), so the step itself is backend work only: the backend captures
    it once per shape and micro-batch count (a CUDA graph) and replays it; the CPU backends run it
    as is. `capture=False` keeps every launch eager, for debugging.
    """

    def __init__(self, model, optimizer: Optimizer, capture: bool = True):
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
        shapes = {np.shape(inputs) for inputs, _ in batches}
        if len(shapes) != 1:
            raise ValueError(f"micro-batches of one step must share a shape, got {sorted(shapes)}")
        counts = sum(model.head_counts(inputs, targets) for inputs, targets in batches)
        if comm is not None:
            counts = comm.host_sum(counts)
        self.optimizer.set_schedule(lr)
        key = (len(batches), shapes.pop())
        program = self._programs.get(key)
        if program is None:
            prepared = [model.prepare(inputs, targets, counts) for inputs, targets in batches]

            def step():
                last = len(prepared) - 1   # whose backward completes the step's gradients
                losses = [model.forward_backward(batch, accumulate=k > 0,
                                                 grads_ready=self.optimizer.grads_ready_hook(final=k == last))
                          for k, batch in enumerate(prepared)]
                return losses, self.optimizer.update()

            replay, result = be.capture(step) if self.capture else (step, step())
            self._programs[key] = (prepared, replay)
        else:
            prepared, replay = program
            for (inputs, targets), batch in zip(batches, prepared):
                model.prepare(inputs, targets, counts, out=batch)
            result = replay()
        losses, norms = result
        loss = sum(model.loss_of(batch, l) for batch, l in zip(prepared, losses))
        if comm is not None:
            loss = float(comm.host_sum(np.array([loss]))[0])
        return loss, self.optimizer.host_norm(norms)


def check_graph_replay(backend: str, cfg=None, steps: int = 3, seed: int = 0, precision: str = "fp32",
                       optimizer: str = "adamw"):
    """A captured training step (replayed) against the same steps launched eagerly, with the
    optimizer called `optimizer`: losses, gradient norms and weights must agree exactly (a
    gradcheck TensorCheck with bound 0)."""
    from nanoeuler_core.engine.gradcheck import TensorCheck, tiny_batch, tiny_config
    from nanoeuler_core.engine.model import Model

    cfg = cfg or tiny_config()
    results = []
    for capture in (True, False):
        model = Model(cfg, backend=backend, seed=seed, precision=precision)
        step = TrainStep(model, make_optimizer(optimizer, model), capture=capture)
        rng = np.random.default_rng(seed)
        history = [step(*tiny_batch(cfg, rng, B=2, T=cfg.ctx_len), 1e-3) for _ in range(steps)]
        results.append((history, model.backend.to_host(model.flat)))
    (replayed, w_replayed), (eager, w_eager) = results
    worst = float(np.max(np.abs(w_replayed - w_eager)))
    if replayed != eager:
        worst = max(worst, float(np.max(np.abs(np.array(replayed) - np.array(eager)))))
    return TensorCheck(f"{steps} steps with {optimizer}, graph vs eager", worst, 0.0)
