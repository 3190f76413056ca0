"""The nanoeuler model, readable top to bottom: a decoder-only transformer whose blocks are two
forward-Euler steps (docs/model.md),

    x = x + attn(rmsnorm(x; attn_norm))
    x = x + swiglu(rmsnorm(x; ffn_norm))

then a final rmsnorm and K multi-token-prediction heads (head 0 may read the embedding table:
`tie_embeddings`). There is no autograd tape: `_forward`
keeps what the backward needs in an explicit cache, and `_backward_blocks` walks the blocks in reverse,
calling each op's backward by hand, as llm.c's gpt2_backward does.

Each step's residual add is fused with the norm that follows it (`add_rmsnorm`: the attention
step's sum with ffn_norm, the feed-forward step's sum with the next block's attn_norm, or the final
norm), so the residual stream is read once per step. q, k and v come from one matrix product with
the stacked weights [wq; wk; wv], gate and up from one with [w_gate; w_up]: both stacks are
adjacent in the parameter buffer, so they are views, not copies.

Every op comes from the registry and runs on the chosen backend ("reference": NumPy float64,
"cpu": Numba, "cuda": Numba CUDA); the model never touches a backend's internals. All
parameters live in one flat buffer with named views, matrices first so that weight decay covers
the prefix [0, n_decay) (the blocks' matrices lead, block after block: the hidden matrices Muon
updates are the prefix [0, n_hidden)); the gradients live in a twin buffer, into which every op's backward adds
its parameter gradient in place (the buffer is zeroed once at the start of a step), as llm.c does;
ZeRO-2 trades the twin buffer for a few reusable buckets (`gradients_in`).

The K heads and their cross-entropy are one registered op, `classifier` (llm.c's fused
classifier): it makes the logits a chunk of rows at a time and, in training, turns each chunk into
its losses and its gradient in place, so the (N, V) logits of the heads never exist at once.
With tied embeddings the classifier's weight gradient for head 0 and the embedding's backward
both add into tok_emb's gradient.

Training goes through two public calls: `prepare(inputs, targets)` turns a host batch into a
`Batch` on the backend (ids, each head's targets, each row's weight in the objective), and
`forward_backward(batch)` runs the forward and the backward, filling the gradient buffer; both
are what a captured training step (nanoeuler_core.training.step) replays.

Activation recomputation (`recompute=True`, the command line's `--recompute`, llm.c's `-r`): the
forward keeps only each block's input (`BlockInput`) instead of its whole `BlockCache`, and the
backward runs a block's forward again from that input just before the block's backward, as
activation checkpointing does. Peak activation memory drops to about one block's cache plus the
blocks' inputs, for one more forward of the blocks; the kernels are deterministic, so the
gradients are the same, bit for bit. `forward_backward` is the one place that chooses.

Precision (docs/model.md, nanoeuler_core.registry.Precision): FP32; TF32 (float32 storage,
TF32 matrix products); BF16 (mixed precision: the float32 buffer holds the master weights and
receives float32 gradients, while the forward and backward read a bf16 copy of the weights,
refreshed after each update, and keep activations and activation gradients in bf16; the ops
accumulate in float32). The model takes its ops from the registry in its precision, which reaches
the kernels that need it (TF32 products) as an argument.

Shapes: B batch, T time, C = dim, H query heads, KV key/value heads, D = C / H, F = hidden_dim,
V = vocab_size, N = B * T rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from nanoeuler_core import quantized, registry
from nanoeuler_core.engine.checkpoint import FORMAT, CheckpointError, load_tensors, read_json, save_tensors, write_json
from nanoeuler_core.engine.config import ModelConfig

MODEL_OPS = ("embedding", "rmsnorm", "add_rmsnorm", "linear", "qkv_rope", "attention", "swiglu", "add",
             "classifier")
STACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}   # one matrix product each
QUANTIZED_PARTS = ("q", "scale", "zero")   # a quantized matrix's tensors in a run's file: name.q, ...


@dataclass
class BlockInput:
    """What recomputation keeps of a block: its input, from which the backward runs its forward again."""

    x: object           # the residual stream entering the block (N, C)
    h_attn: object      # rmsnorm(x; attn_norm) (N, C), as the norm before the block computed it


@dataclass
class BlockCache:
    """What one block's backward needs from its forward (all (N, .) rows unless noted)."""

    h_attn: object      # rmsnorm(block input; attn_norm) (N, C)
    qkv: object         # h_attn @ wqkv.T (B, T, (H + 2 KV) D)
    q: object           # after RoPE (B, T, H, D)
    k: object           # after RoPE (B, T, KV, D)
    v: object           # (B, T, KV, D)
    attn_saved: tuple   # (o (B, T, H, D), lse (B, H, T))
    ffn_saved: tuple    # add_rmsnorm's: (x_mid = input + attention branch (N, C), its rstd (N,))
    h_ffn: object       # rmsnorm(x_mid; ffn_norm) (N, C)
    gate_up: object     # h_ffn @ w_gate_up.T (N, 2F)
    act: object         # silu(gate) * up (N, F)
    out_saved: tuple    # add_rmsnorm's: (block output = x_mid + feed-forward branch, its rstd under the next norm)


@dataclass
class Batch:
    """A batch on the model's backend, as `forward_backward` takes it: token ids (N,), each head's
    targets (K, N) (-1 = no target) and each row's weight in the objective (K, N); the weights
    also on the host, to sum the losses (`Model.loss_of`). N = B * T."""

    B: int
    T: int
    ids: object
    head_targets: object
    weights: object
    host_weights: np.ndarray


def _computing(method):
    """Run a method inside the model's backend's set-up (see Model.computing)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.computing():
            return method(self, *args, **kwargs)
    return run


class Model:
    def __init__(self, cfg: ModelConfig, backend: str = "cpu", seed: int = 0, precision: str | None = None,
                 recompute: bool = False):
        self.cfg = cfg
        self.recompute = recompute   # training keeps only each block's input, and recomputes the rest (see above)
        self.backend_name = backend
        self.backend = registry.usable_backend(backend)
        self.precision = self.backend.check_precision(precision or self.backend.default_precision)
        self.ops = registry.kernels_on(backend, MODEL_OPS, self.precision)

        shapes = cfg.param_shapes()
        # The blocks' matrices first, block after block (Muon's group: [0, n_hidden)), then the
        # other matrices, then the vectors: weight decay applies to the prefix [0, n_decay).
        hidden = [n for n, s in shapes.items() if len(s) == 2 and n.startswith("layers.")]
        order = hidden + [n for n, s in shapes.items() if len(s) == 2 and n not in hidden] + \
            [n for n, s in shapes.items() if len(s) == 1]
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name in order:
            self.layout[name] = (offset, shapes[name])
            offset += int(np.prod(shapes[name]))
        self.n_params = offset
        self.n_hidden = sum(int(np.prod(shapes[n])) for n in hidden)
        self.n_decay = sum(int(np.prod(s)) for s in shapes.values() if len(s) == 2)
        # one block's matrices in buffer order: the pattern that repeats n_layers times over [0, n_hidden)
        self.block_matrices = tuple(shapes[n] for n in hidden if n.startswith("layers.0."))

        self.flat = self.backend.asarray(self._init_flat(seed))   # the master weights
        self.grad_flat = self.backend.zeros(self.n_params)
        # what the forward and backward read: the master weights, or their copy in the precision's storage
        low = self.precision.storage != "fp32"
        self.compute_flat = self.backend.zeros(self.n_params, self.precision.storage) if low else self.flat
        self.refresh_compute_weights()
        self.master = self._views(self.flat)
        self.weights = self._views(self.compute_flat)
        self.forward_weights = self.weight_set(self.compute_flat)
        self.layers, self.next_norms = self.forward_weights.layers, self.forward_weights.next_norms
        # name -> (q, scale, zero) on the host: the matrices a quantized run stores, whose dequantized
        # values the master weights hold (docs/files.md, "Quantized runs")
        self.quantized: dict[str, tuple] = {}
        # (K V, C); tied, head 0 is tok_emb, which the layout puts just before heads.1
        self.heads = self.stacked(self.compute_flat, cfg.head_names())
        self.gradients_in(self.grad_flat)

    def gradients_in(self, buffer, flat: bool = True) -> None:
        """Make the backward add every gradient into `buffer`: the flat gradient buffer (n_params,),
        or (`flat=False`) an object that maps each slice of the layout the model takes (a tensor,
        a stack of adjacent ones) to backend memory, such as ZeRO-2's reusable buckets
        (nanoeuler_core.engine.optim). `grad_flat` is then None, and whoever hands out the memory
        zeroes it, bucket by bucket."""
        self.grad_flat = buffer if flat else None
        self.grads = self._views(buffer)
        self.layer_grads = self.block_weights(buffer)
        self.head_grads = self.stacked(buffer, self.cfg.head_names())
        self.next_norm_grads = [G.attn_norm for G in self.layer_grads[1:]] + [self.grads["norm"]]

    # ----------------------------------------------------------------------------------------
    # parameters

    def _init_flat(self, seed: int) -> np.ndarray:
        """The initialisation of docs/model.md: matrices ~ N(0, 0.02); wo and w_down scaled by 1/sqrt(2 n_layers); norms 1."""
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
        """name -> view of `flat`, in the order of docs/model.md's parameter table."""
        views = {}
        for name in self.cfg.param_shapes():
            offset, shape = self.layout[name]
            views[name] = flat[offset:offset + int(np.prod(shape))].reshape(shape)
        return views

    def stacked(self, flat, names: list[str]):
        """The named matrices stacked by rows, (sum of their rows, C), as a view of `flat` (the
        parameter, compute-copy or gradient buffer); ValueError unless they lie next to each other
        there (the layout keeps wq, wk, wv, then w_gate, w_up, and the heads adjacent)."""
        first, (_, cols) = self.layout[names[0]]
        end = first
        for name in names:
            offset, shape = self.layout[name]
            if offset != end:
                raise ValueError(f"{names} are not adjacent in the parameter buffer")
            end += int(np.prod(shape))
        return flat[first:end].reshape(-1, cols)

    def block_weights(self, flat) -> list[SimpleNamespace]:
        """Each block's tensors as views of `flat` (the master weights, their compute copy or the
        gradient buffer) by short name (attn_norm, wq, ...), with the stacked matrices of STACKED
        (wqkv, w_gate_up) that the forward multiplies by."""
        tensors = self._views(flat)
        blocks = []
        for i in range(self.cfg.n_layers):
            prefix = f"layers.{i}."
            block = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
            for stack, names in STACKED.items():
                block[stack] = self.stacked(flat, [prefix + n for n in names])
            blocks.append(SimpleNamespace(**block))
        return blocks

    def weight_set(self, flat, precision=None) -> SimpleNamespace:
        """What the blocks' forward reads, as views of `flat` (the master weights or a bf16 copy):
        the embedding table, each block's tensors (block_weights), and the norm after each block
        (the next block's attn_norm, the final norm after the last); and the ops that read them,
        in `precision` (default: the model's)."""
        views, layers = self._views(flat), self.block_weights(flat)
        ops = self.ops if precision in (None, self.precision) else \
            registry.kernels_on(self.backend_name, MODEL_OPS, precision)
        return SimpleNamespace(tok_emb=views["tok_emb"], layers=layers, ops=ops,
                               next_norms=[L.attn_norm for L in layers[1:]] + [views["norm"]])

    @property
    def params(self) -> dict[str, np.ndarray]:
        """name -> array: views into the parameter buffer on the CPU backends, host copies for "cuda"."""
        return {name: self.backend.to_host(w) for name, w in self.master.items()}

    def refresh_compute_weights(self) -> None:
        """Copy the master weights into the bf16 copy the ops read (nothing to do in fp32 and tf32);
        backend work only, so a captured step includes it."""
        if self.compute_flat is not self.flat:
            self.backend.copy_(self.compute_flat, self.flat)

    def computing(self):
        """The context every computation of this model runs in (its backend's set-up)."""
        return self.backend.computing()

    def load_params(self, params: dict, keep_quantized: bool = False) -> None:
        """Copy `params` (name -> array with the shapes of docs/model.md) into the model (which
        forgets its quantized matrices, unless `keep_quantized`: params are their values)."""
        expected = self.cfg.param_shapes()
        missing, unexpected = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        if missing or unexpected:
            raise ValueError(f"parameter names do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, shape in expected.items():
            value = np.asarray(params[name])
            if value.shape != shape:
                raise ValueError(f"parameter '{name}' has shape {value.shape}, the model expects {shape}")
        for name in expected:
            self.backend.copy_(self.master[name], np.ascontiguousarray(params[name], dtype=self.backend.dtype))
        self.refresh_compute_weights()
        if not keep_quantized:
            self.quantized = {}

    # ----------------------------------------------------------------------------------------
    # batches

    def _check_inputs(self, ids: np.ndarray, name: str = "inputs") -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an integer array of shape (B, T), got {ids.dtype} {ids.shape}")
        if not 1 <= ids.shape[1] <= self.cfg.ctx_len:
            raise ValueError(f"sequence length {ids.shape[1]} must be between 1 and ctx_len={self.cfg.ctx_len}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64)

    def _check_targets(self, targets, ids: np.ndarray) -> np.ndarray:
        targets = np.asarray(targets)
        if targets.shape != ids.shape or targets.dtype.kind not in "iu":
            raise ValueError(f"targets must be an integer array of shape {ids.shape}, got {targets.dtype} {targets.shape}")
        if targets.size and (targets.min() < -1 or targets.max() >= self.cfg.vocab_size):
            raise ValueError(f"targets must be -1 (ignored) or in [0, {self.cfg.vocab_size})")
        return targets.astype(np.int64)

    def head_targets(self, targets: np.ndarray) -> np.ndarray:
        """(B, T) next-token targets -> (K, B * T): head j at position t predicts targets[:, t + j]; -1 past the end."""
        K = self.cfg.n_mtp
        B, T = targets.shape
        shifted = np.full((K, B, T), -1, dtype=np.int64)
        for j in range(K):
            shifted[j, :, :T - j] = targets[:, j:]
        return shifted.reshape(K, B * T)

    def head_counts(self, inputs, targets) -> np.ndarray:
        """The valid targets of each head (K,) in a batch: what `prepare`'s `counts` sums over the
        micro-batches and ranks of one step."""
        return (self.head_targets(self._check_targets(targets, self._check_inputs(inputs))) >= 0).sum(axis=1)

    def mtp_weights(self, head_targets: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
        """Row weights (K, N) that make sum(weights * losses) the MTP loss: the mean over heads of
        each head's mean over its valid targets; heads without any valid target do not count.

        `counts` (K,), the valid targets of each head over a larger batch these rows belong to
        (micro-batches, data-parallel ranks), makes the weights those of that whole batch."""
        valid = head_targets >= 0
        counts = valid.sum(axis=1) if counts is None else np.asarray(counts)
        n_active = max(1, int((counts > 0).sum()))
        return valid / np.maximum(counts, 1)[:, None] / n_active

    def prepare(self, inputs, targets, counts=None, token_weights=None, out: Batch | None = None) -> Batch:
        """Check a host batch and put it on the backend, as `forward_backward` takes it.

        inputs, targets: int (B, T), targets -1 = ignored. The objective is the MTP loss (every
        head, weighted as `mtp_weights` says, over a step whose head counts are `counts`), or,
        with `token_weights` (B, T), sum(token_weights * cross-entropy of head 0) alone (for
        objectives on log-probabilities, such as DPO's). `out`, a Batch of the same shape, is
        refilled instead of allocating new buffers (a captured step reads the same ones).
        """
        ids = self._check_inputs(inputs)
        targets = self._check_targets(targets, ids)
        if token_weights is None:
            head_targets = self.head_targets(targets)
            weights = self.mtp_weights(head_targets, counts)
        else:
            token_weights = np.asarray(token_weights, dtype=np.float64)
            if token_weights.shape != ids.shape:
                raise ValueError(f"weights shape {token_weights.shape} must equal inputs shape {ids.shape}")
            head_targets = np.full((self.cfg.n_mtp, ids.size), -1, dtype=np.int64)
            head_targets[0] = targets.reshape(-1)
            weights = np.zeros(head_targets.shape)
            weights[0] = token_weights.reshape(-1) * (head_targets[0] >= 0)
        host = (ids.reshape(-1), head_targets, weights)
        be = self.backend
        if out is None:
            return Batch(*ids.shape, *(be.asarray(a) for a in host), weights)
        if (out.B, out.T) != ids.shape:
            raise ValueError(f"a batch of shape {ids.shape} cannot refill buffers of shape {(out.B, out.T)}")
        for buffer, values in zip((out.ids, out.head_targets, out.weights), host):
            be.copy_(buffer, values)
        out.host_weights = weights
        return out

    def loss_of(self, batch: Batch, losses) -> float:
        """The objective's value: sum(weights * per-row losses) of what forward_backward returned."""
        return float((batch.host_weights * self._host_losses(losses)).sum())

    def _host_losses(self, losses) -> np.ndarray:
        """Per-row losses (backend (k, N)) as a host float64 array."""
        return np.asarray(self.backend.to_host(losses), dtype=np.float64)

    # ----------------------------------------------------------------------------------------
    # forward

    def _forward(self, ids, B: int, T: int, keep: str | None = None, weights=None):
        """ids (N,) on the backend -> final hidden state (N, C) (after the final norm), what each
        block keeps for its backward (keep="cache": its BlockCache; "input": its BlockInput alone,
        for recomputation; None: nothing), and the first norm's input and rstd. `weights`: a
        weight_set (default: the model's compute weights)."""
        w = weights or self.forward_weights
        f, eps = w.ops, self.cfg.norm_eps
        x, _ = f.embedding.forward(ids, w.tok_emb)
        h_attn, (rstd,) = f.rmsnorm.forward(x, w.layers[0].attn_norm, eps=eps)
        first_saved = (x, rstd)
        kept = []
        for i in range(self.cfg.n_layers):
            block_input = BlockInput(x, h_attn)
            x, h_attn, cache = self._block_forward(i, block_input, B, T, w)
            if keep is not None:
                kept.append(cache if keep == "cache" else block_input)
            del cache   # unless kept, a block's cache is gone before the next block runs
        return h_attn, kept, first_saved

    def _block_forward(self, i: int, inp: BlockInput, B: int, T: int, weights=None):
        """Block i from its input -> the next block's input x (N, C), its normalised copy h (the
        next block's attn_norm, or the final norm, applied), and what the block's backward needs."""
        w = weights or self.forward_weights
        cfg, f, L = self.cfg, w.ops, w.layers[i]
        N, H, KV, D, eps = B * T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        # attention Euler step: x_mid = x + wo(attention(rope(q), rope(k), v)), h_attn = rmsnorm(x)
        qkv, _ = f.linear.forward(inp.h_attn, L.wqkv)
        qkv = qkv.reshape(B, T, (H + 2 * KV) * D)
        (q, k, v), _ = f.qkv_rope.forward(qkv, n_heads=H, n_kv_heads=KV, theta=cfg.rope_theta)
        o, attn_saved = f.attention.forward(q, k, v)
        attn_out, _ = f.linear.forward(o.reshape(N, H * D), L.wo)
        (x_mid, h_ffn), ffn_saved = f.add_rmsnorm.forward(inp.x, attn_out, L.ffn_norm, eps=eps)
        # feed-forward Euler step: x_out = x_mid + w_down(silu(w_gate h) * w_up h), h = rmsnorm(x_mid)
        gate_up, _ = f.linear.forward(h_ffn, L.w_gate_up)
        act, _ = f.swiglu.forward(gate_up)
        ffn_out, _ = f.linear.forward(act, L.w_down)
        # the step's residual add with the next norm: the next block's input and its normalised copy
        (x_out, h_next), out_saved = f.add_rmsnorm.forward(x_mid, ffn_out, w.next_norms[i], eps=eps)
        return x_out, h_next, BlockCache(inp.h_attn, qkv, q, k, v, attn_saved, ffn_saved, h_ffn, gate_up, act, out_saved)

    def _upload_ids(self, inputs):
        ids = self._check_inputs(inputs)
        return ids, self.backend.asarray(ids.reshape(-1))

    @_computing
    def forward(self, inputs) -> np.ndarray:
        """inputs int (B, T) -> logits float (B, T, vocab_size) from head 0, as a host array."""
        ids, ids_dev = self._upload_ids(inputs)
        h_final, _, _ = self._forward(ids_dev, *ids.shape)
        logits, _ = self.ops.linear.forward(h_final, self.heads[:self.cfg.vocab_size])
        return self.backend.to_host(logits).reshape(*ids.shape, self.cfg.vocab_size)

    # ----------------------------------------------------------------------------------------
    # loss and backward

    def _heads(self, h_final, head_targets, weights=None):
        """Per-row cross-entropy (k, N) of heads 0 .. k-1 against head_targets (backend (k, N)), by
        the fused classifier op.

        With `weights` (backend (k, N)), the same call also runs the backward of sum(weights *
        losses): the heads' gradients are added into the gradient buffer and dh_final (N, C) is
        returned. Returns (losses, dh_final or None).
        """
        rows = head_targets.shape[0] * self.cfg.vocab_size
        losses, grads = self.ops.classifier.forward(h_final, self.heads[:rows], head_targets, dlosses=weights,
                                                    into=(None, self.head_grads[:rows], None))
        return losses, (grads[0] if weights is not None else None)

    @_computing
    def forward_backward(self, batch: Batch, accumulate: bool = False, grads_ready=None):
        """Forward, then the gradient of the batch's objective (sum of weights * per-row losses over
        every head) into `grad_flat`, added to what it holds with `accumulate` (micro-batches).
        Returns the per-row losses of every head (backend (K, N); `loss_of` sums them).

        `grads_ready(names)`, if given, is called as soon as the gradients of those parameters are
        final, with each of `gradient_reports()` in turn (the data-parallel sums start from there);
        gradients kept outside a flat buffer (`gradients_in`) need it: it hands out their memory.
        Only backend work, no host copy: a backend with graphs captures it as it stands.
        """
        if self.grad_flat is None and grads_ready is None:
            raise RuntimeError("the gradients live in buckets (ZeRO-2): the backward must report them (grads_ready)")
        if not accumulate and self.grad_flat is not None:
            self.backend.zero_(self.grad_flat)
        grads_ready = grads_ready or (lambda names: None)
        reports = self.gradient_reports()
        # the one choice of recomputation: keep every block's cache, or only its input
        keep = "input" if self.recompute else "cache"
        h_final, kept, first_saved = self._forward(batch.ids, batch.B, batch.T, keep)
        losses, dh_final = self._heads(h_final, batch.head_targets, batch.weights)
        grads_ready(reports[0])
        self._backward_blocks(dh_final, kept, first_saved, batch.ids, batch.B, batch.T, grads_ready, reports)
        return losses

    def gradient_reports(self) -> list[list[str]]:
        """The parameters whose gradients the backward reports final together (`grads_ready`), in
        the order it reports them: the heads (a tied tok_emb is not final yet: the embedding's
        backward adds to it last), each block from the last to the first (its own parameters but
        attn_norm, which the block below adds to, and the norm after it), then the first norm and
        the embedding table. The backward writes report j's gradients after reporting j - 1;
        report 0's, and a tied tok_emb's, from its start."""
        L = self.cfg.n_layers
        blocks = [[n for n in self.layout if n.startswith(f"layers.{i}.") and not n.endswith(".attn_norm")]
                  + [f"layers.{i + 1}.attn_norm" if i + 1 < L else "norm"] for i in reversed(range(L))]
        return [[n for n in self.cfg.head_names() if n != "tok_emb"], *blocks, ["layers.0.attn_norm", "tok_emb"]]

    def _backward_blocks(self, dh, kept: list, first_saved: tuple, ids, B: int, T: int, grads_ready,
                         reports: list[list[str]]) -> None:
        """Walk the blocks in reverse from dh (N, C), the gradient at the final norm's output, to
        tok_emb, consuming what the forward kept of each block (its cache, or its input to run it
        again from); every weight's gradient is added into the gradient buffer, and each block's
        parameters reported to `grads_ready` once their gradients are final (`reports`)."""
        cfg, f, eps = self.cfg, self.ops, self.cfg.norm_eps
        dx = None   # the gradient reaching the residual stream past the last block: none
        for i in reversed(range(cfg.n_layers)):
            dx, dh = self._block_backward(i, self._block_cache(i, kept.pop(), B, T), dx, dh, B, T)
            grads_ready(reports[cfg.n_layers - i])
        # dh is now the gradient at the first norm's output: through it, and the stream, to the embedding
        x_emb, rstd = first_saved
        dx_norm, _ = f.rmsnorm.backward(dh, (rstd,), x_emb, self.layers[0].attn_norm, eps=eps,
                                        into=(None, self.layer_grads[0].attn_norm))
        dx, _ = f.add.forward(dx, dx_norm)
        f.embedding.backward(dx, (), ids, self.weights["tok_emb"], into=(None, self.grads["tok_emb"]))
        grads_ready(reports[-1])

    def _block_cache(self, i: int, kept, B: int, T: int) -> BlockCache:
        """Block i's cache: as the forward kept it, or its forward run again from the kept input
        (recomputation: the same kernels on the same input, so the same values)."""
        return kept if isinstance(kept, BlockCache) else self._block_forward(i, kept, B, T)[2]

    def _block_backward(self, i: int, c: BlockCache, dx, dh, B: int, T: int):
        """Block i's backward: from dx (N, C), the gradient reaching the residual stream past the
        block (None past the last), and dh (N, C), the one at the next norm's output, to those at
        the block's input and at its attn_norm's output; the block's weight gradients (and the
        next norm's) are added into the gradient buffer. The cache `c` dies with the call."""
        cfg, f, L, G = self.cfg, self.ops, self.layers[i], self.layer_grads[i]
        N, H, KV, D, eps = B * T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        # feed-forward step's residual add and the next norm: dx_mid reaches both x_mid and ffn_out
        dx_mid, _, _ = f.add_rmsnorm.backward((dx, dh), c.out_saved, None, None, self.next_norms[i], eps=eps,
                                              into=(None, None, self.next_norm_grads[i]))
        dact, _ = f.linear.backward(dx_mid, (), c.act, L.w_down, into=(None, G.w_down))
        (dgate_up,) = f.swiglu.backward(dact, (), c.gate_up)
        dh_ffn, _ = f.linear.backward(dgate_up, (), c.h_ffn, L.w_gate_up, into=(None, G.w_gate_up))
        # attention step's residual add and ffn_norm: dx reaches both the block input and attn_out
        dx, dattn_out, _ = f.add_rmsnorm.backward((dx_mid, dh_ffn), c.ffn_saved, None, None, L.ffn_norm, eps=eps,
                                                  into=(None, None, G.ffn_norm))
        do, _ = f.linear.backward(dattn_out, (), c.attn_saved[0].reshape(N, H * D), L.wo, into=(None, G.wo))
        dq, dk, dv = f.attention.backward(do.reshape(B, T, H, D), c.attn_saved, c.q, c.k, c.v)
        (dqkv,) = f.qkv_rope.backward((dq, dk, dv), (), c.qkv, n_heads=H, n_kv_heads=KV, theta=cfg.rope_theta)
        dh, _ = f.linear.backward(dqkv.reshape(N, (H + 2 * KV) * D), (), c.h_attn, L.wqkv, into=(None, G.wqkv))
        return dx, dh

    def loss_and_backward(self, inputs, targets) -> float:
        """The training loss; fills the gradient buffer `grad_flat` (and the `grads` views) without host copies."""
        batch = self.prepare(inputs, targets)
        return self.loss_of(batch, self.forward_backward(batch))

    def loss_and_grad(self, inputs, targets) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and gradients (name -> host array) for int (B, T) inputs and targets (-1 = ignore)."""
        loss = self.loss_and_backward(inputs, targets)
        return loss, {name: np.array(self.backend.to_host(g)) for name, g in self.grads.items()}

    @_computing
    def head_losses(self, inputs, targets) -> np.ndarray:
        """Each head's mean cross-entropy over its valid targets, (K,) float64 (NaN for a head with
        none); head 0's is the usual next-token loss. No gradients."""
        ids, ids_dev = self._upload_ids(inputs)
        head_targets = self.head_targets(self._check_targets(targets, ids))
        valid = head_targets >= 0
        # the heads with a target are a prefix: head j has one wherever head j + 1 has one a step earlier
        n_active = int(valid.any(axis=1).sum())
        means = np.full(self.cfg.n_mtp, np.nan)
        if n_active:
            h_final, _, _ = self._forward(ids_dev, *ids.shape)
            losses, _ = self._heads(h_final, self.backend.asarray(head_targets[:n_active]))
            valid = valid[:n_active]
            means[:n_active] = (self._host_losses(losses) * valid).sum(axis=1) / valid.sum(axis=1)
        return means

    def loss(self, inputs, targets) -> float:
        """The training loss (docs/model.md) without gradients: the mean of the heads' losses."""
        means = self.head_losses(inputs, targets)
        return float(np.nanmean(means)) if not np.isnan(means).all() else 0.0

    @_computing
    def token_logprobs(self, inputs, targets) -> np.ndarray:
        """log p(targets[b, t] | inputs[b, :t + 1]) from head 0, (B, T) float64; 0 where the target is -1."""
        ids, ids_dev = self._upload_ids(inputs)
        targets = self._check_targets(targets, ids)
        h_final, _, _ = self._forward(ids_dev, *ids.shape)
        losses, _ = self._heads(h_final, self.backend.asarray(targets.reshape(1, -1)))
        return -self._host_losses(losses)[0].reshape(ids.shape)

    def logprob_backward(self, inputs, targets, weights, accumulate: bool = False, grads_ready=None) -> np.ndarray:
        """Fill `grad_flat` with the gradient of sum(weights * token_logprobs(inputs, targets)), weights (B, T)
        (add it to what `grad_flat` holds, with `accumulate`; `grads_ready` as for `forward_backward`).

        The building block of objectives on sequence log-probabilities (DPO). Returns the log-probs.
        """
        batch = self.prepare(inputs, targets, token_weights=-np.asarray(weights, dtype=np.float64))  # log p = -CE
        losses = self.forward_backward(batch, accumulate=accumulate, grads_ready=grads_ready)
        return -self._host_losses(losses[:1])[0].reshape(batch.B, batch.T)

    # ----------------------------------------------------------------------------------------
    # files

    def quantize(self, fmt: str, group: int = 0, zero_point: bool = True) -> None:
        """Quantize the matrices decoding reads: the blocks' in `fmt` ("int8" or "int4") with groups
        of `group` weights (0: int8 a scale per output channel, int4 groups of 32), the heads in int8
        (a scale per output channel); the master weights then hold the dequantized values, and
        `save` writes the quantized tensors (docs/files.md, "Quantized runs")."""
        group = group or quantized.DEFAULT_GROUP[fmt]
        params = self.params
        formats = {name: (fmt, group) for name in self.cfg.param_shapes() if name.startswith("layers.")
                   and len(params[name].shape) == 2}
        formats |= {name: ("int8", 0) for name in self.cfg.head_names()}
        self.quantized = {name: quantized.quantize(params[name], f, g, zero_point) for name, (f, g) in formats.items()}
        self.load_params(params | {name: quantized.dequantize(*w) for name, w in self.quantized.items()},
                         keep_quantized=True)

    def _saved_tensors(self) -> dict[str, np.ndarray]:
        """The tensors `save` writes: the parameters, each quantized matrix as name.q, name.scale,
        name.zero, unless the model has learnt since (its master weights no longer its dequantized
        values: then the float weights, which lose nothing)."""
        tensors = self.params
        for name, w in list(self.quantized.items()):
            if np.array_equal(quantized.dequantize(*w).astype(np.float32), tensors[name]):
                del tensors[name]
                tensors |= {f"{name}.{part}": a for part, a in zip(QUANTIZED_PARTS, w)}
            else:
                del self.quantized[name]
        return tensors

    def save(self, run_dir, training: dict | None = None) -> None:
        """Write config.json and model.safetensors (docs/files.md) into `run_dir`, atomically."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_tensors(run_dir / "model.safetensors", self._saved_tensors())
        config = {"format": FORMAT, **self.cfg.to_dict()}
        if training is not None:
            config["training"] = training
        write_json(run_dir / "config.json", config)

    @classmethod
    def load(cls, run_dir, backend: str = "cpu", precision: str | None = None) -> "Model":
        """The model saved in `run_dir` (float32 files, whatever precision trained them), to run in
        `precision` (the backend's default if None); CheckpointError if files are missing, corrupt
        or mismatched."""
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
        model = cls(cfg, backend=backend, precision=precision)
        try:
            parts = {name[:-2] for name in tensors if name.endswith(".q")}
            # (float32 scales and offsets, as older runs store them, become float16: docs/files.md)
            model.quantized = {name: quantized.half_scales(*(tensors.pop(f"{name}.{part}") for part in QUANTIZED_PARTS))
                               for name in parts}
            tensors |= {name: quantized.dequantize(*w) for name, w in model.quantized.items()}
            model.load_params(tensors, keep_quantized=True)
        except ValueError as exc:
            raise CheckpointError(f"{run_dir / 'model.safetensors'} does not match config.json: {exc}") from None
        return model
