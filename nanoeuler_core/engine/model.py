"""The nanoeuler model, readable top to bottom: a decoder-only transformer whose blocks are two
forward-Euler steps (SPEC.md section 1),

    x = x + attn(rmsnorm(x; attn_norm))
    x = x + swiglu(rmsnorm(x; ffn_norm))

then a final rmsnorm and K multi-token-prediction heads. There is no autograd tape: `_forward`
keeps what the backward needs in an explicit cache, and `_backward_blocks` walks the blocks in reverse,
calling each op's backward by hand, as llm.c's gpt2_backward does.

Every op comes from the registry and runs on the chosen backend ("reference": NumPy float64,
"cpu": Numba, "cuda": Numba CUDA); the model never touches a backend's internals. All
parameters live in one flat buffer with named views, matrices first so that weight decay covers
the prefix [0, n_decay); the gradients live in a twin buffer.

Shapes: B batch, T time, C = dim, H query heads, KV key/value heads, D = C / H, F = hidden_dim,
V = vocab_size, N = B * T rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.engine.checkpoint import FORMAT, CheckpointError, load_tensors, read_json, save_tensors, write_json
from nanoeuler_core.engine.config import ModelConfig

MODEL_OPS = ("embedding", "rmsnorm", "linear", "rope", "attention", "swiglu", "add", "cross_entropy")


@dataclass
class BlockCache:
    """What one block's backward needs from its forward (all (N, .) rows unless noted)."""

    x_in: object        # block input (N, C)
    h_attn: object      # rmsnorm(x_in) (N, C)
    rstd_attn: object   # (N,)
    q: object           # after RoPE (B, T, H, D)
    k: object           # after RoPE (B, T, KV, D)
    v: object           # (B, T, KV, D)
    attn_saved: tuple   # (o (B, T, H, D), lse (B, H, T))
    x_mid: object       # x_in + attention branch (N, C)
    h_ffn: object       # rmsnorm(x_mid) (N, C)
    rstd_ffn: object    # (N,)
    gate: object        # (N, F)
    up: object          # (N, F)
    act: object         # silu(gate) * up (N, F)


class Model:
    def __init__(self, cfg: ModelConfig, backend: str = "cpu", seed: int = 0):
        self.cfg = cfg
        self.backend_name = backend
        self.backend = usable_backend(backend)
        self.ops = SimpleNamespace(**{name: registry.op(name).impl(backend) for name in MODEL_OPS})

        shapes = cfg.param_shapes()
        # Matrices first: weight decay applies to the prefix [0, n_decay) of the flat buffer.
        order = [n for n, s in shapes.items() if len(s) == 2] + [n for n, s in shapes.items() if len(s) == 1]
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name in order:
            self.layout[name] = (offset, shapes[name])
            offset += int(np.prod(shapes[name]))
        self.n_params = offset
        self.n_decay = sum(int(np.prod(s)) for s in shapes.values() if len(s) == 2)

        self.flat = self.backend.asarray(self._init_flat(seed))
        self.grad_flat = self.backend.zeros(self.n_params)
        self.weights = self._views(self.flat)
        self.grads = self._views(self.grad_flat)
        self.layers = [self._layer(self.weights, i) for i in range(cfg.n_layers)]
        self.layer_grads = [self._layer(self.grads, i) for i in range(cfg.n_layers)]

    # ----------------------------------------------------------------------------------------
    # parameters

    def _init_flat(self, seed: int) -> np.ndarray:
        """SPEC.md initialisation: matrices ~ N(0, 0.02); wo and w_down scaled by 1/sqrt(2 n_layers); norms 1."""
        rng = np.random.default_rng(seed)
        flat = np.empty(self.n_params, dtype=np.float64)
        out_std = 0.02 / np.sqrt(2 * self.cfg.n_layers)
        for name, shape in self.cfg.param_shapes().items():
            offset, _ = self.layout[name]
            size = int(np.prod(shape))
            if len(shape) == 1:
                flat[offset:offset + size] = 1.0
            else:
                std = out_std if name.endswith((".wo", ".w_down")) else 0.02
                flat[offset:offset + size] = rng.normal(0.0, std, size)
        return flat

    def _views(self, flat) -> dict:
        """name -> view of `flat`, in SPEC.md section 2 order."""
        views = {}
        for name in self.cfg.param_shapes():
            offset, shape = self.layout[name]
            views[name] = flat[offset:offset + int(np.prod(shape))].reshape(shape)
        return views

    @staticmethod
    def _layer(tensors: dict, i: int) -> SimpleNamespace:
        prefix = f"layers.{i}."
        return SimpleNamespace(**{n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})

    @property
    def params(self) -> dict[str, np.ndarray]:
        """name -> array: views into the parameter buffer on the CPU backends, host copies for "cuda"."""
        return {name: self.backend.to_host(w) for name, w in self.weights.items()}

    def load_params(self, params: dict) -> None:
        """Copy `params` (name -> array with the shapes of SPEC.md section 2) into the model."""
        expected = self.cfg.param_shapes()
        missing, unexpected = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        if missing or unexpected:
            raise ValueError(f"parameter names do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, shape in expected.items():
            value = np.asarray(params[name])
            if value.shape != shape:
                raise ValueError(f"parameter '{name}' has shape {value.shape}, the model expects {shape}")
        for name in expected:
            self.backend.copy_(self.weights[name], np.ascontiguousarray(params[name], dtype=self.backend.dtype))

    # ----------------------------------------------------------------------------------------
    # forward

    def _check_inputs(self, ids: np.ndarray, name: str = "inputs") -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an integer array of shape (B, T), got {ids.dtype} {ids.shape}")
        if not 1 <= ids.shape[1] <= self.cfg.ctx_len:
            raise ValueError(f"sequence length {ids.shape[1]} must be between 1 and ctx_len={self.cfg.ctx_len}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64)

    def _forward(self, ids, B: int, T: int, kv: list | None = None, start: int = 0):
        """ids (N,) on the backend -> final hidden state (N, C), per-block caches, and the final
        norm's input and cache.

        With a KV cache (generation, B = 1), the tokens sit at positions start .. start + T - 1:
        their keys and values are appended to `kv` and attention reads every cached position.
        """
        cfg, f, be = self.cfg, self.ops, self.backend
        N, H, KV, D, eps = B * T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        S = start + T  # key positions visible to the last query

        x, _ = f.embedding.forward(ids, self.weights["tok_emb"])
        caches = []
        for i, L in enumerate(self.layers):
            # attention Euler step: x = x + wo(attention(rope(q), rope(k), v)) of rmsnorm(x)
            h_attn, (rstd_attn,) = f.rmsnorm.forward(x, L.attn_norm, eps=eps)
            q, _ = f.linear.forward(h_attn, L.wq)
            k, _ = f.linear.forward(h_attn, L.wk)
            v, _ = f.linear.forward(h_attn, L.wv)
            q, _ = f.rope.forward(q.reshape(B, T, H, D), theta=cfg.rope_theta, start_pos=start)
            k, _ = f.rope.forward(k.reshape(B, T, KV, D), theta=cfg.rope_theta, start_pos=start)
            v = v.reshape(B, T, KV, D)
            k_all, v_all = k, v
            if kv is not None:
                k_cache, v_cache = kv[i]  # (ctx_len, KV, D) each
                be.copy_(k_cache[start:S], k.reshape(T, KV, D))
                be.copy_(v_cache[start:S], v.reshape(T, KV, D))
                k_all, v_all = k_cache[:S].reshape(1, S, KV, D), v_cache[:S].reshape(1, S, KV, D)
            o, attn_saved = f.attention.forward(q, k_all, v_all)
            attn_out, _ = f.linear.forward(o.reshape(N, H * D), L.wo)
            x_mid, _ = f.add.forward(x, attn_out)
            # feed-forward Euler step: x = x + w_down(silu(w_gate h) * w_up h) of rmsnorm(x)
            h_ffn, (rstd_ffn,) = f.rmsnorm.forward(x_mid, L.ffn_norm, eps=eps)
            gate, _ = f.linear.forward(h_ffn, L.w_gate)
            up, _ = f.linear.forward(h_ffn, L.w_up)
            act, _ = f.swiglu.forward(gate, up)
            ffn_out, _ = f.linear.forward(act, L.w_down)
            caches.append(BlockCache(x, h_attn, rstd_attn, q, k, v, attn_saved, x_mid, h_ffn, rstd_ffn, gate, up, act))
            x, _ = f.add.forward(x_mid, ffn_out)
        h_final, (rstd_final,) = f.rmsnorm.forward(x, self.weights["norm"], eps=eps)
        return h_final, caches, (x, rstd_final)

    def _upload_ids(self, inputs):
        ids = self._check_inputs(inputs)
        return ids, self.backend.asarray(ids.reshape(-1))

    def forward(self, inputs) -> np.ndarray:
        """inputs int (B, T) -> logits float (B, T, vocab_size) from head 0, as a host array."""
        ids, ids_dev = self._upload_ids(inputs)
        h_final, _, _ = self._forward(ids_dev, *ids.shape)
        logits, _ = self.ops.linear.forward(h_final, self.weights["heads.0"])
        return self.backend.to_host(logits).reshape(*ids.shape, self.cfg.vocab_size)

    # ----------------------------------------------------------------------------------------
    # loss and backward

    def head_targets(self, targets: np.ndarray) -> np.ndarray:
        """(B, T) next-token targets -> (K, B * T): head j at position t predicts targets[:, t + j]; -1 past the end."""
        K = self.cfg.n_mtp
        B, T = targets.shape
        shifted = np.full((K, B, T), -1, dtype=np.int64)
        for j in range(K):
            shifted[j, :, :T - j] = targets[:, j:]
        return shifted.reshape(K, B * T)

    def _check_targets(self, targets, ids: np.ndarray) -> np.ndarray:
        targets = np.asarray(targets)
        if targets.shape != ids.shape or targets.dtype.kind not in "iu":
            raise ValueError(f"targets must be an integer array of shape {ids.shape}, got {targets.dtype} {targets.shape}")
        if targets.size and (targets.min() < -1 or targets.max() >= self.cfg.vocab_size):
            raise ValueError(f"targets must be -1 (ignored) or in [0, {self.cfg.vocab_size})")
        return targets.astype(np.int64)

    def mtp_weights(self, head_targets: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
        """Row weights (K, N) that make sum(weights * losses) the MTP loss: the mean over heads of
        each head's mean over its valid targets; heads without any valid target do not count.

        `counts` (K,), the valid targets of each head over a larger batch these rows belong to
        (micro-batches, data-parallel ranks), makes the weights those of that whole batch."""
        valid = head_targets >= 0
        counts = valid.sum(axis=1) if counts is None else np.asarray(counts)
        n_active = max(1, int((counts > 0).sum()))
        return valid / np.maximum(counts, 1)[:, None] / n_active

    def _store_grad(self, dst, grad, accumulate: bool) -> None:
        """dst <- grad, or dst <- dst + grad when accumulating micro-batches into the gradient buffer."""
        if accumulate:
            grad, _ = self.ops.add.forward(dst, grad)
        self.backend.copy_(dst, grad)

    def _heads(self, h_final, head_targets, heads, weights=None, accumulate=False):
        """Per-row cross-entropy (N,) of each head j in `heads` against head_targets[j] (backend (K, N)).

        With `weights` (backend (K, N)), also the backward of sum(weights * losses): the heads'
        gradients are written (added, with `accumulate`) and dh_final (N, C) is returned.
        Returns (losses per head, dh_final).
        """
        f = self.ops
        losses, dh_final = [], None
        for j in heads:
            head = self.weights[f"heads.{j}"]
            logits, _ = f.linear.forward(h_final, head)
            losses_j, ce_saved = f.cross_entropy.forward(logits, head_targets[j])
            losses.append(losses_j)
            if weights is None:
                continue
            dlogits, _ = f.cross_entropy.backward(weights[j], ce_saved, logits, head_targets[j])
            dh_j, dhead_j = f.linear.backward(dlogits, (), h_final, head)
            self._store_grad(self.grads[f"heads.{j}"], dhead_j, accumulate)
            if dh_final is None:
                dh_final = dh_j
            else:
                dh_final, _ = f.add.forward(dh_final, dh_j)
        return losses, dh_final

    def _forward_backward(self, ids, head_targets, weights, B: int, T: int, accumulate: bool = False) -> list:
        """Forward, then the gradient of sum(weights * per-row losses) of every head into
        `grad_flat` (added to what it holds, with `accumulate`); all arguments on the backend.
        Returns the losses per head (backend (N,) each).

        Only backend work, no host copy: a backend with graphs captures it as it stands.
        """
        h_final, caches, (x_final, rstd_final) = self._forward(ids, B, T)
        losses, dh_final = self._heads(h_final, head_targets, range(self.cfg.n_mtp), weights, accumulate)
        dx, dnorm = self.ops.rmsnorm.backward(dh_final, (rstd_final,), x_final, self.weights["norm"], eps=self.cfg.norm_eps)
        self._store_grad(self.grads["norm"], dnorm, accumulate)
        self._backward_blocks(dx, caches, ids, B, T, accumulate)
        return losses

    def _host_losses(self, losses: list) -> np.ndarray:
        return np.stack([np.asarray(self.backend.to_host(l), dtype=np.float64) for l in losses])

    def head_losses(self, inputs, targets) -> np.ndarray:
        """Each head's mean cross-entropy over its valid targets, (K,) float64 (NaN for a head with
        none); head 0's is the usual next-token loss. No gradients."""
        ids, ids_dev = self._upload_ids(inputs)
        head_targets = self.head_targets(self._check_targets(targets, ids))
        valid = head_targets >= 0
        active = [j for j in range(self.cfg.n_mtp) if valid[j].any()]
        h_final, _, _ = self._forward(ids_dev, *ids.shape)
        losses, _ = self._heads(h_final, self.backend.asarray(head_targets), active)
        means = np.full(self.cfg.n_mtp, np.nan)
        means[active] = (self._host_losses(losses) * valid[active]).sum(axis=1) / valid[active].sum(axis=1)
        return means

    def loss(self, inputs, targets) -> float:
        """The training loss (SPEC.md section 1) without gradients: the mean of the heads' losses."""
        means = self.head_losses(inputs, targets)
        return float(np.nanmean(means)) if not np.isnan(means).all() else 0.0

    def loss_and_backward(self, inputs, targets) -> float:
        """The training loss; fills the gradient buffer `grad_flat` (and the `grads` views) without host copies."""
        ids, ids_dev = self._upload_ids(inputs)
        head_targets = self.head_targets(self._check_targets(targets, ids))
        weights = self.mtp_weights(head_targets)
        be = self.backend
        losses = self._forward_backward(ids_dev, be.asarray(head_targets), be.asarray(weights), *ids.shape)
        return float((weights * self._host_losses(losses)).sum())

    def token_logprobs(self, inputs, targets) -> np.ndarray:
        """log p(targets[b, t] | inputs[b, :t + 1]) from head 0, (B, T) float64; 0 where the target is -1."""
        ids, ids_dev = self._upload_ids(inputs)
        targets = self._check_targets(targets, ids)
        h_final, _, _ = self._forward(ids_dev, *ids.shape)
        losses, _ = self._heads(h_final, self.backend.asarray(targets.reshape(1, -1)), [0])
        return -self._host_losses(losses)[0].reshape(ids.shape)

    def logprob_backward(self, inputs, targets, weights, accumulate: bool = False) -> np.ndarray:
        """Fill `grad_flat` with the gradient of sum(weights * token_logprobs(inputs, targets)), weights (B, T)
        (add it to what `grad_flat` holds, with `accumulate`).

        The building block of objectives on sequence log-probabilities (DPO). Returns the log-probs.
        """
        ids, ids_dev = self._upload_ids(inputs)
        targets = self._check_targets(targets, ids)
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != ids.shape:
            raise ValueError(f"weights shape {weights.shape} must equal inputs shape {ids.shape}")
        head_targets = np.full((self.cfg.n_mtp, ids.size), -1, dtype=np.int64)
        head_targets[0] = targets.reshape(-1)
        head_weights = np.zeros(head_targets.shape)
        head_weights[0] = -weights.reshape(-1) * (targets.reshape(-1) >= 0)  # log p = -cross-entropy
        be = self.backend
        losses = self._forward_backward(ids_dev, be.asarray(head_targets), be.asarray(head_weights), *ids.shape,
                                        accumulate=accumulate)
        return -self._host_losses(losses[:1])[0].reshape(ids.shape)

    def _backward_blocks(self, dx, caches: list[BlockCache], ids_dev, B: int, T: int, accumulate: bool = False) -> None:
        """Walk the blocks in reverse from dx (N, C), the gradient at the last block's output, to
        tok_emb, consuming `caches`; the weights' gradients are written (added, with `accumulate`)."""
        cfg, f = self.cfg, self.ops
        N, H, KV, D, eps = B * T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        for L, G in zip(reversed(self.layers), reversed(self.layer_grads)):
            c = caches.pop()  # dropped after this block: its activations can be freed
            # feed-forward step: x_out = x_mid + w_down(swiglu(gate, up)); dx flows to both terms
            dact, dw_down = f.linear.backward(dx, (), c.act, L.w_down)
            dgate, dup = f.swiglu.backward(dact, (), c.gate, c.up)
            dh_gate, dw_gate = f.linear.backward(dgate, (), c.h_ffn, L.w_gate)
            dh_up, dw_up = f.linear.backward(dup, (), c.h_ffn, L.w_up)
            dh_ffn, _ = f.add.forward(dh_gate, dh_up)
            dx_branch, dffn_norm = f.rmsnorm.backward(dh_ffn, (c.rstd_ffn,), c.x_mid, L.ffn_norm, eps=eps)
            dx, _ = f.add.forward(dx, dx_branch)
            # attention step: x_mid = x_in + wo(attention(q, k, v))
            do, dwo = f.linear.backward(dx, (), c.attn_saved[0].reshape(N, H * D), L.wo)
            dq, dk, dv = f.attention.backward(do.reshape(B, T, H, D), c.attn_saved, c.q, c.k, c.v)
            (dq,) = f.rope.backward(dq, (), c.q, theta=cfg.rope_theta)
            (dk,) = f.rope.backward(dk, (), c.k, theta=cfg.rope_theta)
            dh_q, dwq = f.linear.backward(dq.reshape(N, H * D), (), c.h_attn, L.wq)
            dh_k, dwk = f.linear.backward(dk.reshape(N, KV * D), (), c.h_attn, L.wk)
            dh_v, dwv = f.linear.backward(dv.reshape(N, KV * D), (), c.h_attn, L.wv)
            dh_attn, _ = f.add.forward(dh_q, dh_k)
            dh_attn, _ = f.add.forward(dh_attn, dh_v)
            dx_branch, dattn_norm = f.rmsnorm.backward(dh_attn, (c.rstd_attn,), c.x_in, L.attn_norm, eps=eps)
            dx, _ = f.add.forward(dx, dx_branch)
            for name, grad in (("w_down", dw_down), ("w_gate", dw_gate), ("w_up", dw_up), ("ffn_norm", dffn_norm),
                               ("wo", dwo), ("wq", dwq), ("wk", dwk), ("wv", dwv), ("attn_norm", dattn_norm)):
                self._store_grad(getattr(G, name), grad, accumulate)
        _, dtok = f.embedding.backward(dx, (), ids_dev, self.weights["tok_emb"])
        self._store_grad(self.grads["tok_emb"], dtok, accumulate)

    def loss_and_grad(self, inputs, targets) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and gradients (name -> host array) for int (B, T) inputs and targets (-1 = ignore)."""
        loss = self.loss_and_backward(inputs, targets)
        return loss, {name: np.array(self.backend.to_host(g)) for name, g in self.grads.items()}

    # ----------------------------------------------------------------------------------------
    # files

    def save(self, run_dir, training: dict | None = None) -> None:
        """Write config.json and model.safetensors (SPEC.md section 4) into `run_dir`, atomically."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_tensors(run_dir / "model.safetensors", self.params)
        config = {"format": FORMAT, **self.cfg.to_dict()}
        if training is not None:
            config["training"] = training
        write_json(run_dir / "config.json", config)

    @classmethod
    def load(cls, run_dir, backend: str = "cpu") -> "Model":
        """The model saved in `run_dir`; CheckpointError if files are missing, corrupt or mismatched."""
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise CheckpointError(f"run directory {run_dir} does not exist")
        config = read_json(run_dir / "config.json")
        fields = {k: v for k, v in config.items() if k not in ("format", "training")}
        try:
            cfg = ModelConfig.from_dict(fields)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{run_dir / 'config.json'}: invalid model config: {exc}") from None
        tensors, _ = load_tensors(run_dir / "model.safetensors")
        model = cls(cfg, backend=backend)
        try:
            model.load_params(tensors)
        except ValueError as exc:
            raise CheckpointError(f"{run_dir / 'model.safetensors'} does not match config.json: {exc}") from None
        return model

    # ----------------------------------------------------------------------------------------
    # generation (nanoeuler_core.inference.generate holds it; these are the SPEC.md API)

    def generate(self, tok, prompt: str, *args, **sampling) -> str:
        """Continue `prompt`; returns the new text. See nanoeuler_core.inference.generate.generate."""
        from nanoeuler_core.inference.generate import generate

        return generate(self, tok, prompt, *args, **sampling)

    def chat(self, tok, messages: list[dict], **sampling) -> str:
        """Reply to a conversation of {"role", "content"} messages. See nanoeuler_core.inference.chat."""
        from nanoeuler_core.inference.chat import chat

        return chat(self, tok, messages, **sampling)


def usable_backend(name: str):
    """The registered backend `name`, if it can run here; else a ValueError saying why not."""
    backend = registry.backend(name)
    if not backend.available():
        hint = " (it needs an NVIDIA GPU and pip install 'nanoeuler[cuda]')" if name == "cuda" else ""
        raise ValueError(f"backend '{name}' is not available on this machine{hint}")
    return backend
