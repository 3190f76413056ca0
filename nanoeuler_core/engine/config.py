"""Model configuration: the fields docs/model.md describes, the presets, and the parameter layout.

The presets, by size (parameter counts exact, `tests/test_model.py` asserts them; each is a
multiple of 8, so that ZeRO-1 shards the parameters evenly over 2, 4 or 8 ranks):

| preset | dim | layers | heads / kv heads | hidden_dim | ctx_len | parameters | for |
|---|---|---|---|---|---|---|---|
| `small` | 128 | 4 | 4 / 2 | 344 | 128 | 1,053,824 | the CPU, minutes |
| `cpu-medium` | 384 | 8 | 6 / 2 | 1024 | 256 | 13,572,480 | a CPU of many cores |
| `gpu` | 768 | 16 | 12 / 4 | 2048 | 512 | 116,417,280 | one GPU |
| `gpu-medium` | 1024 | 24 | 16 / 4 | 2816 | 1024 | 291,554,304 | one GPU (GPT-2 medium's width and depth) |
| `gpu-large` | 1280 | 36 | 20 / 5 | 3328 | 1024 | 633,826,560 | one GPU with `--recompute` (GPT-2 large's) |

The GPU presets share a 4,096-entry vocabulary, K = 4 heads, head_dim 64, a few query heads per
key/value head (3 in `gpu`, 4 in the larger two) and hidden_dim = 8/3 dim rounded to a multiple
of 256. With the vocabulary of GPT-2 (50,257) the larger two would be its 350M and 774M.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

PRESETS = {
    "small": dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=344, ctx_len=128, n_mtp=4),
    "cpu-medium": dict(vocab_size=512, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, hidden_dim=1024, ctx_len=256,
                       n_mtp=4),
    "gpu": dict(vocab_size=4096, dim=768, n_layers=16, n_heads=12, n_kv_heads=4, hidden_dim=2048, ctx_len=512, n_mtp=4),
    "gpu-medium": dict(vocab_size=4096, dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, hidden_dim=2816, ctx_len=1024,
                       n_mtp=4),
    "gpu-large": dict(vocab_size=4096, dim=1280, n_layers=36, n_heads=20, n_kv_heads=5, hidden_dim=3328, ctx_len=1024,
                      n_mtp=4),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 344
    ctx_len: int = 128
    n_mtp: int = 4
    tie_embeddings: bool = False   # head 0 reads the embedding table tok_emb: no heads.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset '{name}' (choose from: {', '.join(PRESETS)})")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "ctx_len", "n_mtp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dimension dim / n_heads = {self.head_dim} must be even for RoPE")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError("rope_theta and norm_eps must be positive")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape (docs/model.md), in model order."""
        C, KVD, F, V = self.dim, self.n_kv_heads * self.head_dim, self.hidden_dim, self.vocab_size
        shapes = {"tok_emb": (V, C)}
        for i in range(self.n_layers):
            shapes |= {
                f"layers.{i}.attn_norm": (C,),
                f"layers.{i}.wq": (C, C),
                f"layers.{i}.wk": (KVD, C),
                f"layers.{i}.wv": (KVD, C),
                f"layers.{i}.wo": (C, C),
                f"layers.{i}.ffn_norm": (C,),
                f"layers.{i}.w_gate": (F, C),
                f"layers.{i}.w_up": (F, C),
                f"layers.{i}.w_down": (C, F),
            }
        shapes["norm"] = (C,)
        shapes |= {name: (V, C) for name in self.head_names() if name != "tok_emb"}
        return shapes

    def head_names(self) -> list[str]:
        """The matrices of heads 0 .. K-1 (V, C) each: heads.j, or with tie_embeddings tok_emb for head 0."""
        return ["tok_emb" if j == 0 and self.tie_embeddings else f"heads.{j}" for j in range(self.n_mtp)]

    def n_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            size = 1
            for s in shape:
                size *= s
            total += size
        return total

    def flops_per_token(self) -> float:
        """Training FLOPs per token as nanoGPT's estimate_mfu counts them: 6 per matrix weight
        (embedding lookup and norms excluded; a tied table counts once, as head 0) plus 12 L C T for
        the attention scores."""
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.dim
        n_matmul = self.n_params() - lookup - (2 * self.n_layers + 1) * self.dim
        return 6 * n_matmul + 12 * self.n_layers * self.dim * self.ctx_len
