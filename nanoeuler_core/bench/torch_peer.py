"""The nanoeuler architecture in PyTorch, the peer of `nanoeuler-run bench` and of the decoding
benchmark (the engine never imports it).

Same math as docs/model.md and the same parameter names and layout, so
`TorchModel(cfg).load(model.params)` runs the very weights of a nanoeuler model. Decoding uses a
static KV cache, gpt-fast style: `setup_cache(batch, length)` allocates it once, and
`next_token(ids, pos)` feeds tokens at positions `pos` with fixed shapes, so torch.compile can
capture one step as a CUDA graph (mode="reduce-overhead").
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from nanoeuler_core.bench.measure import peak_rss_mb


def rope_tables(T: int, D: int, theta: float, start: int = 0, device=None):
    inv_freq = theta ** (-np.arange(0, D // 2) * 2.0 / D)
    angles = np.outer(np.arange(start, start + T), inv_freq)
    return (torch.tensor(np.cos(angles), dtype=torch.float32, device=device),
            torch.tensor(np.sin(angles), dtype=torch.float32, device=device))


def rope(u, cos, sin):
    # u (B, T, H, D); rotate-half as in Hugging Face Llama
    d = u.shape[-1] // 2
    u1, u2 = u[..., :d], u[..., d:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([u1 * c - u2 * s, u2 * c + u1 * s], dim=-1)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TorchModel(torch.nn.Module):
    def __init__(self, cfg, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict({
            name.replace(".", "_"): torch.nn.Parameter(torch.empty(shape, device=device))
            for name, shape in cfg.param_shapes().items()
        })
        self.device = device

    def load(self, params: dict) -> "TorchModel":
        with torch.no_grad():
            for name, value in params.items():
                self.p[name.replace(".", "_")].copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)))
        return self

    def w(self, name):
        return self.p[name.replace(".", "_")]

    @property
    def head0(self):
        """Head 0's matrix (V, C): heads.0, or tok_emb where the model ties them."""
        return self.w(self.cfg.head_names()[0])

    def hidden(self, ids, pos=None):
        """ids (B, T) -> the final norm's output (B, T, C). With `pos` (T,), the tokens sit at those
        positions and attend the static KV cache (setup_cache), which receives their keys and values."""
        cfg = self.cfg
        B, T = ids.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if pos is None:
            cos, sin = rope_tables(T, D, cfg.rope_theta, device=ids.device)
        else:
            cos, sin, mask = self.rope_cos[pos], self.rope_sin[pos], self.causal[pos]  # query at p sees keys 0..p
        x = self.w("tok_emb")[ids]
        for i in range(cfg.n_layers):
            L = lambda n: self.w(f"layers.{i}.{n}")  # noqa: E731
            h = rmsnorm(x, L("attn_norm"), cfg.norm_eps)
            q = rope((h @ L("wq").T).view(B, T, H, D), cos, sin).transpose(1, 2)
            k = rope((h @ L("wk").T).view(B, T, KV, D), cos, sin).transpose(1, 2)
            v = (h @ L("wv").T).view(B, T, KV, D).transpose(1, 2)
            if pos is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                self.k_cache[i][:, :, pos] = k
                self.v_cache[i][:, :, pos] = v
                o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                                   enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, H * D) @ L("wo").T
            h = rmsnorm(x, L("ffn_norm"), cfg.norm_eps)
            x = x + (F.silu(h @ L("w_gate").T) * (h @ L("w_up").T)) @ L("w_down").T
        return rmsnorm(x, self.w("norm"), cfg.norm_eps)

    def loss(self, ids, targets):
        """Mean over the MTP heads of each head's mean cross-entropy (targets -1 ignored)."""
        h = self.hidden(ids)
        T = ids.shape[1]
        losses = []
        for j, head in enumerate(self.cfg.head_names()):
            if T - j <= 0:
                continue
            logits = h[:, : T - j] @ self.w(head).T
            tj = targets[:, j:]
            if (tj >= 0).any():
                losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tj.reshape(-1), ignore_index=-1))
        return sum(losses) / len(losses)

    def logits(self, ids):
        return self.hidden(ids) @ self.head0.T

    def setup_cache(self, batch: int, length: int) -> "TorchModel":
        """Allocate the static KV cache (layers, batch, KV, length, D), the RoPE tables and the causal mask."""
        cfg = self.cfg
        device = self.w("tok_emb").device
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device), persistent=False)
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool, device=device).tril(),
                             persistent=False)
        return self

    def next_token(self, ids, pos):
        """Greedy decoding with the KV cache: ids (B, T) at positions pos (T,) -> head 0's argmax after
        the last of them (B, 1)."""
        return (self.hidden(ids, pos)[:, -1] @ self.head0.T).argmax(-1, keepdim=True)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), before reading a clock."""
    if torch.device(device).type != "cpu":
        torch.cuda.synchronize(device)


def peer_memory_mb(device: str) -> float:
    """Memory in use: the GPU's (total - free) for a GPU device, else this process's peak resident set."""
    if torch.device(device).type != "cpu":
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 2**20
    return peak_rss_mb()
