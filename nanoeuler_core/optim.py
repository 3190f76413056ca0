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
        self.step_count = 0
        self._update = registry.op("adamw").impl(model.backend_name).forward

    def step(self, lr: float) -> float:
        """Apply one update from the model's gradient buffer; returns the gradient norm before clipping."""
        self.step_count += 1
        be, model = self.model.backend, self.model
        sched = be.asarray(np.array([lr, self.step_count], dtype=np.float64))
        norm, _ = self._update(model.flat, model.grad_flat, self.m, self.v, sched,
                               beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                               n_decay=model.n_decay, max_grad_norm=self.max_grad_norm)
        return float(be.to_host(norm)[0])

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
