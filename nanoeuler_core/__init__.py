"""nanoeuler: a GPT-2-class language model trained by a hand-written Numba engine.

    from nanoeuler_core import ModelConfig, Model, Tokenizer
"""

from nanoeuler_core.config import ModelConfig
from nanoeuler_core.model import Model

__all__ = ["ModelConfig", "Model", "Tokenizer"]


def __getattr__(name):
    # The tokenizer is imported on first use: starting the engine does not need it.
    if name == "Tokenizer":
        from nanoeuler_core.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'nanoeuler_core' has no attribute {name!r}")
