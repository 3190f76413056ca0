"""nanoeuler: a GPT-2-class language model trained by a hand-written Numba engine.

    from nanoeuler_core import ModelConfig, Model, Tokenizer, generate, generate_batch, chat

    generate(model, tok, "It was", max_new_tokens=50, temperature=0.8, top_k=40, seed=0)
"""

import os

# The CPU backend's step is hundreds of short parallel kernels on Numba's OpenMP threads, with
# the matrix products run as one OpenBLAS call per thread inside them (OpenBLAS's own pool stays
# idle). OpenMP threads spin a while after each kernel (300,000 spins, libgomp's default when the
# variable is unset; the spin is what catches the next kernel without a wake-up, which on 16
# cores costs 15% of the step at 3,000), and OpenBLAS's idle threads sleep at once so that they
# never compete with them. These act only if set before NumPy and Numba start their pools, which
# importing nanoeuler_core first ensures; a value the user set is kept.
THREAD_ENV = {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "4"}
THREAD_ENV_SET_HERE = [name for name in THREAD_ENV if name not in os.environ]
for _name in THREAD_ENV_SET_HERE:
    os.environ[_name] = THREAD_ENV[_name]

from numba.core.caching import CacheImpl  # noqa: E402

from nanoeuler_core.kernel_cache import stamp_sources  # noqa: E402

stamp_sources(CacheImpl)   # before any kernel is compiled or loaded from the cache

from nanoeuler_core.engine.config import ModelConfig  # noqa: E402
from nanoeuler_core.engine.model import Model  # noqa: E402

__all__ = ["ModelConfig", "Model", "Tokenizer", "generate", "generate_batch", "chat"]


def __getattr__(name):
    # The tokenizer, generation and chat are imported on first use: starting the engine needs none of them.
    if name == "Tokenizer":
        from nanoeuler_core.text.tokenizer import Tokenizer

        return Tokenizer
    if name in ("generate", "generate_batch"):
        from nanoeuler_core.inference import generate

        return getattr(generate, name)
    if name == "chat":
        from nanoeuler_core.inference.chat import chat

        return chat
    raise AttributeError(f"module 'nanoeuler_core' has no attribute {name!r}")
