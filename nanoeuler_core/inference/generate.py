"""Generation: a KV cache per sequence, one position per new token, sampling on the host.

Shapes: ctx_len positions, KV key/value heads of D dims; logits (V,) from head 0.
"""

from __future__ import annotations

import codecs

import numpy as np


def new_kv_cache(model) -> list:
    """Per block, keys and values (ctx_len, KV, D) for every position of one sequence."""
    cfg = model.cfg
    shape = (cfg.ctx_len, cfg.n_kv_heads, cfg.head_dim)
    return [(model.backend.zeros(shape), model.backend.zeros(shape)) for _ in range(cfg.n_layers)]


def next_logits(model, ids, kv: list, start: int) -> np.ndarray:
    """Feed tokens `ids` at positions start.. into the KV cache; head-0 logits (V,) after the last one."""
    ids, ids_dev = model._upload_ids(np.asarray(ids, dtype=np.int64).reshape(1, -1))
    if start + ids.shape[1] > model.cfg.ctx_len:
        raise ValueError(f"positions {start}..{start + ids.shape[1] - 1} exceed ctx_len={model.cfg.ctx_len}")
    h_final, _, _ = model._forward(ids_dev, *ids.shape, kv, start)
    last = h_final[h_final.shape[0] - 1:]
    logits, _ = model.ops.linear.forward(last, model.weights["heads.0"])
    return np.asarray(model.backend.to_host(logits), dtype=np.float64)[0]


def generate(model, tok, prompt: str, max_new_tokens: int = 50, temperature: float = 0.8, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, on_text=None, stop_at_eos: bool = True) -> str:
    """Continue `prompt`; returns the new text (without the prompt).

    A KV cache makes each new token cost one position. Prompts longer than the context keep
    their last ctx_len tokens; when the cache is full it is refilled from the last half context.
    `on_text(piece)` receives the text as it is produced (whole UTF-8 characters). Stops at `</s>`.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} entries but the model's vocab_size is "
                         f"{model.cfg.vocab_size}: use the tokenizer.json saved with the model")
    ctx = model.cfg.ctx_len
    ids = (tok.encode(prompt) or [tok.eos_id])[-ctx:]
    rng = np.random.default_rng(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    kv = new_kv_cache(model)
    logits = next_logits(model, ids, kv, 0)
    position, pieces = len(ids), []
    for _ in range(max_new_tokens):
        token = sample_token(logits, temperature, top_k, top_p, rng)
        if stop_at_eos and token == tok.eos_id:
            break
        ids.append(token)
        piece = decoder.decode(tok.token_bytes(token))
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
        if position == ctx:
            window = ids[-(ctx // 2):]
            logits, position = next_logits(model, window, kv, 0), len(window)
        else:
            logits, position = next_logits(model, [token], kv, position), position + 1
    tail = decoder.decode(b"", final=True)
    if tail and on_text:
        on_text(tail)
    return "".join(pieces) + tail


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
                 rng: np.random.Generator) -> int:
    """Draw the next token from logits (V,): greedy at temperature 0, else softmax(logits / T)
    restricted to the top_k most likely tokens and to the smallest set with probability >= top_p."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k is not None and top_k < z.size:
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p  # the tokens before the mass reaches top_p, plus the one crossing it
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))
