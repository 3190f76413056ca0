"""The decoding step's forward: each row's tokens at their places in the KV cache -> its next tokens
(docs/decoding.md, "The step"). Backend work only, built from registered ops, so that a backend
captures a step once and replays it."""

from __future__ import annotations

DECODE_OPS = ("embedding", "norm_linear", "decode_attention", "linear_residual", "norm_swiglu", "sample")


class DecodeForward:
    """The model's forward for decoding on its backend: the DECODE_OPS kernels `ops`
    (registry.kernels_on) reading the weights `w` (DecodeWeights).

    Shapes: n rows, W tokens fed per row (1..K), C = dim, H query heads, KV key/value heads of D
    dims, F = hidden_dim, V = vocab_size."""

    def __init__(self, model, ops, w):
        self.f, self.cfg, self.be, self.w = ops, model.cfg, model.backend, w

    def step(self, cache, n: int, W: int, box):
        """One decoding step of rows 0..n-1 at width W from the buffers of `cache` (KVCache), which
        it advances; the accepted counts go to box[:n] and the next tokens to box[B:B + n*W], B the
        cache's rows (`box`: a mailbox the host reads). Returns the logits (n*W, W*V), which a row
        that wants log-probabilities reads.

            ids = the token block   (n*W,)    each row's next token and W - 1 proposals
            embedding               -> x (n*W, C)
            per block:
              norm_linear           rmsnorm(x; attn_norm) @ wqkv.T               -> qkv (n, W, H + 2 KV, D)
              decode_attention      RoPE at pos + t, k and v into the cache,
                                    attention over positions 0..pos + t           -> o (n*W, H*D)
              linear_residual       x + o @ wo.T                                 -> x
              norm_swiglu           silu(h @ w_gate.T) * (h @ w_up.T),
                                    h = rmsnorm(x; ffn_norm)                      -> act (n*W, F)
              linear_residual       x + act @ w_down.T                           -> x
            norm_linear             rmsnorm(x; norm) @ heads[0..W-1].T           -> logits (n, W, W, V)
            sample                  keep the proposals head 0 agrees with, draw the next token and
                                    proposals into the token block, advance pos and counters -> accepted (n,)
        """
        x = self.hidden(cache.tokens[:n * W], n, W, cache.kv_rows(n), cache.pos[:n])
        accepted, logits = self.sample(x, n, W, cache.state(0, n, W))
        B = cache.batch
        if W > 1:   # at width 1 every row keeps its one token
            self.be.copy_(box[:n], accepted)
        self.be.copy_(box[B:B + n * W], cache.tokens[:n * W])
        return logits

    def hidden(self, ids, B: int, T: int, kv, pos):
        """Token ids (B*T,) at positions pos[b] + t -> the last block's output (B*T, C); their keys
        and values go into `kv` (each block's (keys, values), (B, S, KV, D))."""
        f, cfg = self.f, self.cfg
        H, KV, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        x, _ = f.embedding.forward(ids, self.w.tok_emb)
        for L, (k_cache, v_cache) in zip(self.w.layers, kv):
            # attention Euler step: x = x + wo(attention(rope(q), rope(k), v)) of rmsnorm(x)
            qkv, _ = f.norm_linear.forward(x, L.attn_norm, *L.wqkv, eps=eps)
            o, _ = f.decode_attention.forward(qkv.reshape(B, T, H + 2 * KV, D), k_cache, v_cache, pos,
                                              n_kv_heads=KV, theta=cfg.rope_theta)
            x, _ = f.linear_residual.forward(o.reshape(B * T, H * D), x, *L.wo)
            # feed-forward Euler step: x = x + w_down(silu(w_gate h) * w_up h) of rmsnorm(x)
            act, _ = f.norm_swiglu.forward(x, L.ffn_norm, *L.w_gate_up, eps=eps)
            x, _ = f.linear_residual.forward(act, x, *L.w_down)
        return x

    def sample(self, x, B: int, T: int, state):
        """Heads 0..W-1 on x (B*T, C), W the width of `state` (KVCache.state: tokens, drafts, seeds,
        counters, pos, the sampling settings and the token masks of B rows), then the sample op on them: the
        accepted counts (B,) and the logits (B*T, W*V)."""
        f, cfg, W = self.f, self.cfg, state[0].shape[1]
        logits, _ = f.norm_linear.forward(x, self.w.norm, *self.w.heads_of(W), eps=cfg.norm_eps)
        accepted, _ = f.sample.forward(logits.reshape(B, T, W, cfg.vocab_size), *state, max_pos=cfg.ctx_len)
        return accepted, logits

