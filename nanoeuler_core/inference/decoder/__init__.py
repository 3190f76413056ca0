"""Decoding with a KV cache, plain or self-speculative with the multi-token-prediction heads
(docs/decoding.md). The parts, in reading order: forward.py (the step), weights.py (what it
multiplies by), kv_cache.py (what it reads and writes), prefill.py (a prompt into a row's cache),
speculation.py (the width of a step), pipeline.py (steps launched, results back), rows.py (a row
on the host), decoder.py (Decoder: the parts together)."""

from nanoeuler_core.inference.decoder.decoder import Decoder, decoder_for
from nanoeuler_core.inference.decoder.rows import MAX_SEED, DecodeStats, Row, Sampling
from nanoeuler_core.inference.decoder.weights import check_weights

__all__ = ["Decoder", "decoder_for", "DecodeStats", "MAX_SEED", "Row", "Sampling", "check_weights"]
