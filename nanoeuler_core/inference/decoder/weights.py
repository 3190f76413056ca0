"""The weights decoding reads: views of the model's float32 master weights or of a bf16 copy, or
int8/int4 quantized matrices (docs/decoding.md, "Weights")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from nanoeuler_core import quantized, registry
from nanoeuler_core.engine.model import STACKED

WEIGHT_OPS = ("norm_linear", "linear_residual", "norm_swiglu")   # the decoding ops that read the matrices
STORAGES = ("bf16", "fp32", *quantized.FORMATS)
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")   # a block's matrices, as the decoding ops read them
HEAD_FORMAT = "int8"      # quantized heads: 8 bits whatever the blocks', as GGUF files keep them


class DecodeWeights:
    """The parameters in the shapes the decoding ops read, the matrices stored as `storage`:
    the embedding table and the final norm (float32 always); each block's norms and its matrices
    (MATRICES, each a weight argument: (w,) or (q, scale, zero)) in `layers`; the K heads stacked
    by rows (K*V, C), read through `heads_of`; and the model's weight set they are taken from
    (`forward`: bf16 or float32, whatever the matrices are).

    bf16 views are of the model's own compute copy where it runs in bf16, else of a copy made here,
    refreshed by `refresh`. Quantized matrices are the model's own where it was loaded quantized
    (`model.quantized`) in the format asked for, else quantized here from the master weights, once:
    a model that learns afterwards is decoded with the weights it had (make a new decoder)."""

    def __init__(self, model, storage: str, K: int):
        self.model, self.storage = model, storage
        self.own_copy = None
        flat = model.flat
        float_storage = "fp32" if storage in quantized.FORMATS else storage
        if float_storage == "bf16":
            if model.precision.storage == "bf16":
                flat = model.compute_flat   # the model keeps it current
            else:
                flat = self.own_copy = model.backend.zeros(model.n_params, "bf16")
                model.backend.copy_(flat, model.flat)
        self.tok_emb, self.norm = model.master["tok_emb"], model.master["norm"]
        self.forward = model.weight_set(flat, registry.precision(float_storage))
        head_names = model.cfg.head_names()[:K]
        if storage in quantized.FORMATS:
            matrix = QuantizedMatrices(model)
            self.layers = [SimpleNamespace(attn_norm=L.attn_norm, ffn_norm=L.ffn_norm,
                                           **{m: matrix(stacked_names(i, m), storage) for m in MATRICES})
                           for i, L in enumerate(self.forward.layers)]
            self.heads = matrix(head_names, HEAD_FORMAT)
        else:
            self.layers = [SimpleNamespace(attn_norm=L.attn_norm, ffn_norm=L.ffn_norm,
                                           **{m: (getattr(L, m),) for m in MATRICES}) for L in self.forward.layers]
            self.heads = (model.stacked(flat, head_names),)
        # heads_of(W) for W = 1..K, made here, outside any captured step (which must not allocate).
        # int8's empty offsets are made, not sliced: a GPU array of no bytes has no rows to slice.
        rows = [W * model.cfg.vocab_size for W in range(1, K + 1)]
        self._heads_of = [tuple(a[:n] if a.shape[1] else model.backend.zeros((n, 0), a.dtype) for a in self.heads)
                          for n in rows]

    def heads_of(self, W: int) -> tuple:
        """The first W heads' weight argument: ((W*V, C),) or its quantized rows."""
        return self._heads_of[W - 1]

    def nbytes(self) -> int:
        """Bytes of the matrices the widest decoding step reads: the blocks' and the K heads'."""
        arguments = [getattr(L, m) for L in self.layers for m in MATRICES] + [self.heads]
        return sum(a.size * np.dtype(a.dtype).itemsize for argument in arguments for a in argument)

    def refresh(self) -> None:
        """Copy the master weights into the bf16 copy made here, if any: the model may have learnt since."""
        if self.own_copy is not None:
            self.model.backend.copy_(self.own_copy, self.model.flat)


def stacked_names(i: int, matrix: str) -> list[str]:
    """The parameters block i's decoding matrix `matrix` stacks by rows (wqkv: wq, wk, wv)."""
    return [f"layers.{i}.{name}" for name in STACKED.get(matrix, (matrix,))]


class QuantizedMatrices:
    """Quantized weight arguments on the model's backend, by the parameters they stack: the
    model's own quantized tensors where they are in the format asked for, else the master
    weights quantized (int8 a scale per output channel, int4 groups of 32 with a zero point)."""

    def __init__(self, model):
        self.model = model
        self.host = None   # the master weights on the host, read once if some matrix is quantized here

    def __call__(self, names: list[str], fmt: str) -> tuple:
        own = getattr(self.model, "quantized", {})
        if all(name in own and quantized.weight_format(*own[name])[0] == fmt for name in names):
            parts = [own[name] for name in names]
        else:
            if self.host is None:
                self.host = self.model.params
            parts = [quantized.quantize(self.host[name], fmt, quantized.DEFAULT_GROUP[fmt]) for name in names]
        return tuple(self.model.backend.asarray(np.ascontiguousarray(a)) for a in quantized.concatenate(parts))


def weights_on(backend: str) -> str:
    """The default storage of the weights decoding reads: "bf16" where the backend runs bf16 and its
    decoding ops that read matrices declare bf16 there, else "fp32"."""
    runs = registry.BF16 in registry.backend(backend).precisions and \
        all("bf16" in registry.op(name).precisions_on(backend) for name in WEIGHT_OPS)
    return "bf16" if runs else "fp32"


def check_weights(backend: str, weights: str | None, model=None) -> str:
    """`weights` (one of STORAGES, or None: the format `model` was loaded quantized in, else the
    backend's default) if decoding on `backend` can read them; else ValueError, one line."""
    if weights is None:
        weights = loaded_format(model) or weights_on(backend)
    if weights not in STORAGES:
        raise ValueError(f"decoding weights must be one of {', '.join(STORAGES)}, got {weights!r}")
    if weights == "bf16" and weights_on(backend) != "bf16":
        raise ValueError(f"bf16 decoding weights need a backend whose decoding ops run bf16, and the "
                         f"{backend} backend's do not here: use fp32 weights")
    return weights


def loaded_format(model) -> str | None:
    """The format of the blocks' matrices of a model loaded quantized (its first block's wq), else None."""
    own = getattr(model, "quantized", None) or {}
    first = own.get("layers.0.wq")
    return quantized.weight_format(*first)[0] if first is not None else None
