"""AdamW over the model's flat parameter buffer, and the learning-rate schedule (SPEC.md section 3).

One call of the registered `adamw` op computes the global gradient norm, clips, and updates every
parameter; weight decay covers the matrices, which the model lays out first ([0, n_decay)).
"""

from __future__ import annotations

import math

import numpy as np

from nanoeuler_core import registry


def lr_at(step: int, peak: float, warmup: int, total: int, final_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `final_ratio * peak` at `total` (1-based step)."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    def __init__(self, model, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0):
        self.model = model
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.max_grad_norm = eps, weight_decay, max_grad_norm
        be = model.backend
        self.m = be.zeros(model.n_params)
        self.v = be.zeros(model.n_params)
        self.sched = be.zeros(2)  # [lr, step] on the backend: a captured step reads them from here
        self.step_count = 0
        self._adamw = registry.op("adamw").impl(model.backend_name).forward

    def set_schedule(self, lr: float) -> None:
        """Start the next step at learning rate `lr` (host work: call before `update`)."""
        self.step_count += 1
        self.model.backend.copy_(self.sched, np.array([lr, self.step_count], dtype=self.model.backend.dtype))

    def update(self):
        """Clip and apply the model's gradient buffer to the master weights, then refresh the copy
        the model computes with (backend work only); returns the norm (1,) on the backend."""
        model = self.model
        norm, _ = self._adamw(model.flat, model.grad_flat, self.m, self.v, self.sched,
                              beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                              n_decay=model.n_decay, max_grad_norm=self.max_grad_norm)
        model.refresh_compute_weights()
        return norm

    def step(self, lr: float) -> float:
        """Apply one update from the model's gradient buffer; returns the gradient norm before clipping."""
        self.set_schedule(lr)
        return float(self.model.backend.to_host(self.update())[0])

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Moments as named tensors (m.<name>, v.<name>) and the step, for optimizer.safetensors."""
        be, layout = self.model.backend, self.model.layout
        m, v = be.to_host(self.m), be.to_host(self.v)
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
        be.copy_(self.m, m)
        be.copy_(self.v, v)
        self.step_count = int(metadata.get("step", 0))


class TrainStep:
    """One optimisation step (forward, backward, clipping, AdamW) on batches of one shape.

    The batch is copied into device buffers that stay put, so the step itself is backend work
    only: the backend captures it once per batch shape (a CUDA graph) and replays it; the CPU
    backends run it as is. `capture=False` keeps every launch eager, for debugging.
    """

    def __init__(self, model, optimizer: AdamW, capture: bool = True):
        self.model, self.optimizer, self.capture = model, optimizer, capture
        self._programs: dict = {}

    def __call__(self, inputs, targets, lr: float) -> tuple[float, float]:
        """Train on one batch; returns (loss, gradient norm before clipping)."""
        model, be = self.model, self.model.backend
        ids = model._check_inputs(inputs)
        head_targets = model.head_targets(model._check_targets(targets, ids))
        weights = model.mtp_weights(head_targets)
        self.optimizer.set_schedule(lr)
        program = self._programs.get(ids.shape)
        if program is None:
            buffers = tuple(be.asarray(a) for a in (ids.reshape(-1), head_targets, weights))

            def step():
                return model._forward_backward(*buffers, *ids.shape), self.optimizer.update()

            replay, result = be.capture(step) if self.capture else (step, step())
            self._programs[ids.shape] = (buffers, replay)
        else:
            buffers, replay = program
            for buffer, host in zip(buffers, (ids.reshape(-1), head_targets, weights)):
                be.copy_(buffer, host)
            result = replay()
        losses, norm = result
        return float((weights * model._host_losses(losses)).sum()), float(be.to_host(norm)[0])
