"""Test setup: without a CUDA driver, run the CUDA backend on Numba's CUDA simulator (ops/cuda/simulator.py),
so the registry-driven checks compare cpu and cuda everywhere (CI included). This must happen before
anything imports numba, hence here. Runs do not compile their kernels ahead in a second process."""

import ctypes.util
import glob
import json
import os

import pytest


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None or bool(glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so*"))


if not _cuda_driver_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# The test processes already keep every core busy: runs do not compile ahead in a second process
# (tests/test_warm.py turns it on where it tests it)
os.environ.setdefault("NANOEULER_COMPILE_AHEAD", "0")
# Two test processes share the cores: idle OpenMP threads stop spinning soon, leaving them to the other
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
# ... and Numba's threads stay free to move, not two processes' workers bound to the same cores
os.environ.setdefault("NANOEULER_PIN_THREADS", "0")


@pytest.fixture(scope="session")
def tok():
    """A small tokenizer trained on prompts like the bundled instruction tasks."""
    from nanoeuler_core.training import sft
    from nanoeuler_core.inference.chat import render_prompt
    from nanoeuler_core.text.tokenizer import Tokenizer

    lines = sft.bundled_tasks().read_text(encoding="utf-8").splitlines()[:300]
    examples = [json.loads(line) for line in lines]
    return Tokenizer.train("".join(render_prompt(e["instruction"]) + e["output"] + "\n" for e in examples), 300)


# The slowest cases (simulated GPU kernels and the compile-ahead check, 20 s to 3 min each), which
# pytest-xdist would otherwise reach late and finish alone. Its work-stealing scheduler hands each of
# the two workers half of the list, in order: the slow cases go to the heads of both halves,
# alternately, listed so that the two shares take about as long.
SLOW_FIRST = ("test_ops.py::test_op_gradcheck[attention-fp32]",
              "test_model.py::test_backend_gradients_match_reference[cuda]",
              "test_model.py::test_recompute_gives_the_same_gradients_bit_for_bit_on_cuda",
              "test_tensor_cores.py::test_tensor_core_kernels_compile_for_hopper",
              "test_precision.py::test_bf16_updates_float32_master_weights_and_saves_float32",
              "test_ops.py::test_op_gradcheck[attention-bf16]",
              "test_ops.py::test_op_gradcheck[sample-fp32]",
              "test_precision.py::test_bf16_model_gradients_within_bound_of_float32",
              "test_ops.py::test_op_gradcheck[decode_attention-fp32]",
              "test_generate.py::test_captured_step_equals_the_cpu_in_fp32_and_bf16",
              "test_ops.py::test_op_gradcheck[muon-fp32]")


def pytest_collection_modifyitems(config, items):
    by_id = {item.nodeid.removeprefix("tests/"): item for item in items}
    slow = [by_id[name] for name in SLOW_FIRST if name in by_id]
    rest = [item for item in items if item not in slow]
    first, second = slow[0::2], slow[1::2]
    half = max(len(first), len(items) // 2)
    items[:] = first + rest[:half - len(first)] + second + rest[half - len(first):]
