"""Prefix caching and chunked prefill: tokens decoded with a cached prefix, with prompts prefilled
a chunk at a time between steps, and with blocks evicted, equal those decoded without (greedy and
seeded sampling); hits and reused tokens are counted; the cache stays within its bound."""

import numpy as np
import pytest

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.inference.decoder import Decoder, Sampling
from nanoeuler_core.inference.decoder import prefill as prefill_module

from cycle_model import cycle_trained

CFG = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=48, ctx_len=96, n_mtp=3)
SYSTEM = [int(t) for t in np.random.default_rng(3).integers(0, 16, 40)]   # a shared prefix: 2 blocks and 8 tokens
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4], SYSTEM[:20] + [5, 6], [7, 8, 9] * 12]
SAMPLINGS = [Sampling(0.0), Sampling(0.8, top_k=8)]


@pytest.fixture(scope="module")
def model():
    return cycle_trained(CFG, steps=10)


def on_backend(model, backend):
    twin = Model(model.cfg, backend=backend)
    twin.load_params(model.params)
    return twin


def alone(model, prompt, sampling, seed, n=12, **kwargs):
    """The tokens of `prompt` decoded alone, in a decoder with no prefix cache."""
    decoder = Decoder(model, 1, False, sampling, prefix_cache_tokens=0, **kwargs)
    return decoder.generate([prompt], n, [seed])[0]


def served(decoder, prompts, sampling, seeds, n=12, steps_between=0):
    """Decode `prompts` through start/prefill_chunk/step, a new prompt started every
    `steps_between` steps (0: all at once), the rows retired as they end; their tokens."""
    tokens, waiting, row_of = {}, list(enumerate(prompts)), {}
    while waiting or row_of or decoder.admitting:
        if waiting and decoder.can_start() and decoder.free_rows():
            i, prompt = waiting.pop(0)
            b = decoder.free_rows()[0]
            decoder.start(b, prompt, seeds[i], sampling, n)
            row_of[b] = i
            if steps_between == 0 and waiting:
                continue
        decoder.prefill_chunk()
        for _ in range(max(1, steps_between)):
            decoder.step()
        for b in [b for b in row_of if decoder.rows[b] is not None and not decoder.rows[b].active]:
            tokens[row_of.pop(b)] = decoder.retire(b).new
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_cached_prefixes_decode_as_prompts_alone(model, sampling):
    """Prompts sharing a prefix with a running row and with finished ones, admitted one after the
    other, each decode as alone without a cache; later prompts reuse the shared blocks."""
    expected = [alone(model, p, sampling, 10 + i) for i, p in enumerate(PROMPTS)]
    decoder = Decoder(model, 2, False, sampling)
    assert served(decoder, PROMPTS, sampling, [10, 11, 12, 13], steps_between=3) == expected
    stats = decoder.prefix_cache.stats()
    # PROMPTS[1] reuses SYSTEM's 2 blocks (PROMPTS[0] still runs), PROMPTS[2] its first block
    assert stats["prefix_cache_hits"] == 2 and stats["prefix_tokens_reused"] == 48
    # the same prompts again: every one finds its blocks, the answers' blocks too
    assert served(decoder, PROMPTS, sampling, [10, 11, 12, 13]) == expected
    assert decoder.prefix_cache.stats()["prefix_cache_hits"] == 6


def test_a_prompt_going_on_from_an_answer_reuses_its_blocks(model):
    """A prompt that repeats a finished row's prompt and answer (a chat's next turn) reuses the
    blocks of the answer, and decodes as alone."""
    decoder = Decoder(model, 1, False, Sampling(0.0))
    first = decoder.generate([PROMPTS[0]], 30, [0])[0]
    follow_up = PROMPTS[0] + first + [3, 4]
    before = decoder.prefix_cache.stats()["prefix_tokens_reused"]
    assert decoder.generate([follow_up], 8, [0])[0] == alone(model, follow_up, Sampling(0.0), 0, 8)
    assert decoder.prefix_cache.stats()["prefix_tokens_reused"] - before == 16 * ((len(follow_up) - 1) // 16)


def test_eviction_keeps_the_bound_and_the_tokens(model):
    """A cache of 3 blocks holds at most 3, evicting the least recently used; a prompt whose first
    block was evicted is prefilled again, and every prompt decodes as alone."""
    sampling = Sampling(0.8)
    decoder = Decoder(model, 1, False, sampling, prefix_cache_tokens=48)
    cache = decoder.prefix_cache
    other = [[t, t + 1] * 16 for t in range(3)]   # 2 blocks each, and 1 more of its answer
    for i, prompt in enumerate([PROMPTS[0], *other, PROMPTS[0]]):
        assert decoder.generate([prompt], 6, [i])[0] == alone(model, prompt, sampling, i, 6)
        assert cache.stats()["prefix_cache_blocks"] <= 3
    stats = cache.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_slots"] == 3
    assert stats["prefix_cache_hits"] == 0   # PROMPTS[0]'s blocks were evicted before it came back


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_gives_the_tokens_of_a_whole_one(model, chunk, monkeypatch):
    """Prompts prefilled `chunk` tokens a forward (over every prompt under way), between decoding
    steps of the rows already running, decode as they do alone; several prompts share a forward."""
    sampling = Sampling(0.8, top_p=0.9)
    expected = [alone(model, p, sampling, i) for i, p in enumerate(PROMPTS)]
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", chunk)
    decoder = Decoder(model, 4, False, sampling, prefix_cache_tokens=0)
    assert served(decoder, PROMPTS, sampling, [0, 1, 2, 3]) == expected


def test_a_row_retired_while_its_prompt_is_prefilled_frees_its_staging_row(model, monkeypatch):
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 4)
    decoder = Decoder(model, 2, False, Sampling(0.0))
    decoder.start(0, PROMPTS[0], 0, Sampling(0.0), 5)
    decoder.prefill_chunk()
    assert 0 not in decoder.free_rows() and decoder.rows[0] is None
    decoder.retire(0)
    assert decoder.free_rows() == [0, 1] and decoder.prefill.free_staging() == prefill_module.STAGING_ROWS
    assert decoder.prefill_chunk() == []


def row_cache(decoder, b, T):
    """Row b's keys and values of positions 0..T-1, every model block, on the host."""
    be = decoder.be
    return [np.array(be.to_host(a))[b, :T] for pair in decoder.cache.kv for a in pair]


def admitted(decoder, b, prompt):
    decoder.start(b, prompt, 0, Sampling(0.0), 4)
    while decoder.rows[b] is None:
        decoder.prefill_chunk()


@pytest.mark.parametrize("backend, blocks", [("cpu", 2), ("cuda", 1)])   # the simulator is slow: one block
def test_a_reused_prefix_leaves_the_keys_and_values_of_a_whole_prefill(model, backend, blocks):
    """A prompt's row holds, bit for bit, the keys and values it holds without the cache, once its
    first blocks come from another row's prompt (on the CUDA simulator: staging rows, chunks and
    blocks copied on the device)."""
    twin = on_backend(model, backend)
    weights = "fp32" if backend == "cuda" else None
    shared = 16 * blocks
    prompt = SYSTEM[:shared + 1] + [5]
    cached = Decoder(twin, 2, False, prefix_cache_tokens=32, weights=weights)
    admitted(cached, 0, SYSTEM[:shared] + [1])
    admitted(cached, 1, prompt)
    assert cached.prefix_cache.stats()["prefix_tokens_reused"] == shared
    plain = Decoder(twin, 2, False, prefix_cache_tokens=0, weights=weights)
    admitted(plain, 1, prompt)
    for got, expected in zip(row_cache(cached, 1, len(prompt)), row_cache(plain, 1, len(prompt))):
        np.testing.assert_array_equal(got, expected)
    assert cached.rows[1].new == plain.rows[1].new


def test_a_negative_bound_is_refused(model):
    with pytest.raises(ValueError, match="prefix cache"):
        Decoder(model, 1, False, prefix_cache_tokens=-1)
