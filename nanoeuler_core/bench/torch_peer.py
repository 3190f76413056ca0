"""The nanoeuler architecture in PyTorch, the peer of `nanoeuler-run bench` (the engine never imports it).

Same math as SPEC.md section 1 and the same parameter names and layout, so
`TorchModel(cfg).load(model.params)` runs the very weights of a nanoeuler model.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


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

    def hidden(self, ids):
        cfg = self.cfg
        B, T = ids.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = rope_tables(T, D, cfg.rope_theta, device=ids.device)
        x = self.w("tok_emb")[ids]
        for i in range(cfg.n_layers):
            L = lambda n: self.w(f"layers.{i}.{n}")  # noqa: E731
            h = rmsnorm(x, L("attn_norm"), cfg.norm_eps)
            q = rope((h @ L("wq").T).view(B, T, H, D), cos, sin).transpose(1, 2)
            k = rope((h @ L("wk").T).view(B, T, KV, D), cos, sin).transpose(1, 2)
            v = (h @ L("wv").T).view(B, T, KV, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, H * D) @ L("wo").T
            h = rmsnorm(x, L("ffn_norm"), cfg.norm_eps)
            x = x + (F.silu(h @ L("w_gate").T) * (h @ L("w_up").T)) @ L("w_down").T
        return rmsnorm(x, self.w("norm"), cfg.norm_eps)

    def loss(self, ids, targets):
        """Mean over the MTP heads of each head's mean cross-entropy (targets -1 ignored)."""
        h = self.hidden(ids)
        T = ids.shape[1]
        losses = []
        for j in range(self.cfg.n_mtp):
            if T - j <= 0:
                continue
            logits = h[:, : T - j] @ self.w(f"heads.{j}").T
            tj = targets[:, j:]
            if (tj >= 0).any():
                losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tj.reshape(-1), ignore_index=-1))
        return sum(losses) / len(losses)

    def logits(self, ids):
        return self.hidden(ids) @ self.w("heads.0").T
