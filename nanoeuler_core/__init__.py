"""nanoeuler: a GPT-2-class language model trained by a hand-written Numba engine.

    from nanoeuler_core import ModelConfig, Model, Tokenizer
"""

import os

# The CPU backend runs OpenBLAS matrix products between Numba's OpenMP kernels. By default both
# thread pools spin long while idle and steal the cores from each other (a 2-core step ran 8x
# slower): OpenMP threads now spin only briefly (enough to catch the next kernel, ~10 us) and
# OpenBLAS threads sleep at once. These act only if set before NumPy and Numba start their pools,
# which importing nanoeuler_core first ensures; a value the user set is kept.
THREAD_ENV = {"GOMP_SPINCOUNT": "3000", "OPENBLAS_THREAD_TIMEOUT": "4"}
THREAD_ENV_SET_HERE = [name for name in THREAD_ENV if name not in os.environ]
for _name in THREAD_ENV_SET_HERE:
    os.environ[_name] = THREAD_ENV[_name]

from nanoeuler_core.engine.config import ModelConfig  # noqa: E402
from nanoeuler_core.inference.model import Model  # noqa: E402

__all__ = ["ModelConfig", "Model", "Tokenizer"]


def __getattr__(name):
    # The tokenizer is imported on first use: starting the engine does not need it.
    if name == "Tokenizer":
        from nanoeuler_core.text.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'nanoeuler_core' has no attribute {name!r}")
