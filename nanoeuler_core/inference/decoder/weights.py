"""The weights decoding reads: views of the model's float32 master weights, or of a bf16 copy
(docs/decoding.md, "Weights")."""

from __future__ import annotations

from nanoeuler_core import registry

WEIGHT_OPS = ("norm_linear", "linear_residual", "norm_swiglu")   # the decoding ops that read bf16 weights


class DecodeWeights:
    """The parameters in the shapes the decoding ops read, stored as `storage` ("bf16" or "fp32"):
    the embedding table and the final norm (float32 always), each block's tensors with the
    stacked matrices wqkv and w_gate_up (`layers`), the K heads stacked by rows (K*V, C), and the
    model's weight set for the prefill's forward (`forward`). bf16 views are of the model's own
    compute copy where it runs in bf16, else of a copy made here, refreshed by `refresh`."""

    def __init__(self, model, storage: str, K: int):
        self.model, self.storage = model, storage
        self.own_copy = None
        flat = model.flat
        if storage == "bf16":
            if model.precision.storage == "bf16":
                flat = model.compute_flat   # the model keeps it current
            else:
                flat = self.own_copy = model.backend.zeros(model.n_params, "bf16")
                model.backend.copy_(flat, model.flat)
        self.tok_emb, self.norm = model.master["tok_emb"], model.master["norm"]
        self.heads = model.stacked(flat, model.cfg.head_names()[:K])
        self.forward = model.weight_set(flat, registry.precision(storage))
        self.layers = self.forward.layers

    def refresh(self) -> None:
        """Copy the master weights into the bf16 copy made here, if any: the model may have learnt since."""
        if self.own_copy is not None:
            self.model.backend.copy_(self.own_copy, self.model.flat)


def weights_on(backend: str) -> str:
    """The default storage of the weights decoding reads: "bf16" where the backend runs bf16 and its
    decoding ops that read matrices declare bf16 there, else "fp32"."""
    runs = registry.BF16 in registry.backend(backend).precisions and \
        all("bf16" in registry.op(name).precisions_on(backend) for name in WEIGHT_OPS)
    return "bf16" if runs else "fp32"


def check_weights(backend: str, weights: str | None) -> str:
    """`weights` ("bf16", "fp32", or None for the backend's default) if decoding on `backend` can read
    them; else ValueError, one line."""
    weights = weights_on(backend) if weights is None else weights
    if weights not in ("bf16", "fp32"):
        raise ValueError(f"weights must be 'bf16' or 'fp32', got {weights!r}")
    if weights == "bf16" and weights_on(backend) != "bf16":
        raise ValueError(f"bf16 decoding weights need a backend whose decoding ops run bf16, and the "
                         f"{backend} backend's do not here: use fp32 weights")
    return weights
