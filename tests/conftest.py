"""Test setup: without a CUDA driver, run the CUDA backend on Numba's CUDA simulator, so the
registry-driven checks compare cpu and cuda everywhere (CI included). This must happen before
anything imports numba, hence here."""

import ctypes.util
import glob
import json
import os

import pytest


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None or bool(glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so*"))


if not _cuda_driver_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


@pytest.fixture(scope="session")
def tok():
    """A small tokenizer trained on prompts like the bundled instruction tasks."""
    from nanoeuler_core.training import sft
    from nanoeuler_core.inference.chat import render_prompt
    from nanoeuler_core.text.tokenizer import Tokenizer

    lines = sft.bundled_tasks().read_text(encoding="utf-8").splitlines()[:300]
    examples = [json.loads(line) for line in lines]
    return Tokenizer.train("".join(render_prompt(e["instruction"]) + e["output"] + "\n" for e in examples), 300)
