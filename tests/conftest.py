"""Test setup: without a CUDA driver, run the CUDA backend on Numba's CUDA simulator, so the
registry-driven checks compare cpu and cuda everywhere (CI included). This must happen before
anything imports numba, hence here. Runs do not compile their kernels ahead in a second process."""

import ctypes.util
import glob
import json
import os
import sys
import threading
from types import SimpleNamespace

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


class _BlockBarrier:
    """syncthreads for one simulated block: a thread waits until every thread still running has
    arrived (a thread that has returned no longer counts, as Numba's simulator has it); abort()
    releases the waiting threads with an error when one thread has failed."""

    def __init__(self, threads: int) -> None:
        self._live, self._waiting, self._generation, self._broken = threads, 0, 0, False
        self._cond = threading.Condition()

    def wait(self) -> None:
        with self._cond:
            generation = self._generation
            self._waiting += 1
            if self._waiting == self._live:
                self._release()
            while generation == self._generation and not self._broken:
                self._cond.wait()
            if self._broken:
                raise RuntimeError("another thread of the block failed")

    def leave(self) -> None:
        with self._cond:
            self._live -= 1
            if self._waiting and self._waiting == self._live:
                self._release()

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()

    def _release(self) -> None:
        self._waiting = 0
        self._generation += 1
        self._cond.notify_all()


def _simulator_blocks_on_barriers() -> None:
    """Numba's CUDA simulator runs each CUDA thread of a block as a Python thread, started for that
    block, and a manager thread polls them in a loop to release them together at syncthreads: every
    block pays for starting its threads, and every barrier waits for the loop to come round while
    the loop competes with the threads for the GIL. Here (numba-cuda 0.30.4's BlockManager.run and
    BlockThread.syncthreads replaced) a pool of threads, one per thread position of a block shape,
    runs block after block, and a block's threads meet at a condition-variable barrier (the last to
    arrive releases the others): nothing is started per block and nothing polls. And a shared array
    is found by its caller's frame, not by a whole extracted stack per thread (`shared_array`).
    Another numba-cuda keeps its own simulator (correct, only slower)."""
    import importlib.metadata

    import numpy as np

    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" or importlib.metadata.version("numba-cuda") != "0.30.4":
        return
    from numba.cuda.simulator import kernel, kernelapi

    class PooledThread(kernel.BlockThread):
        """One thread position of a block shape, running the blocks handed to it one at a time."""

        def __init__(self, block_dim, thread_point):
            super().__init__(None, SimpleNamespace(_block_dim=block_dim), (0, 0, 0), thread_point, False)
            self.block = None                      # (manager, grid point, args, finished) of the next block
            self.ready = threading.Event()

        def run(self):
            while True:
                self.ready.wait()
                self.ready.clear()
                manager, grid_point, args, finished = self.block
                self._manager, self.blockIdx, self.exception = manager, kernel.Dim3(*grid_point), None
                try:
                    manager._f(*args)
                except Exception as e:
                    message = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                    self.exception = (type(e)(f"{message}: {e}" if str(e) else message), sys.exc_info()[2])
                    manager.failed.append(self)
                    manager.barrier.abort()
                finally:
                    manager.barrier.leave()
                    finished()

    pools: dict = {}    # block shape -> its pooled threads

    def run(self, grid_point, *args):
        block_dim = tuple(self._block_dim)
        if block_dim not in pools:
            pools[block_dim] = [PooledThread(block_dim, point) for point in np.ndindex(*block_dim)]
            for t in pools[block_dim]:
                t.start()
        threads = pools[block_dim]
        self.barrier, self.failed = _BlockBarrier(len(threads)), []
        done = threading.Condition()
        left = [len(threads)]

        def finished():
            with done:
                left[0] -= 1
                if left[0] == 0:
                    done.notify()

        for t in threads:
            t.block = (self, grid_point, args, finished)
            t.ready.set()
        with done:
            while left[0]:
                done.wait()
        for t in self.failed[:1]:   # the first thread that failed, not those the abort released
            raise t.exception[0].with_traceback(t.exception[1])

    def syncthreads(self):
        self._manager.barrier.wait()

    def shared_array(self, shape, dtype, alignment=None):
        # numba-cuda's FakeCUDAShared.array, keyed by its caller's file and line as there, read from
        # the caller's frame instead of a whole extracted stack (which every thread of every block
        # built for every shared array)
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        if shape == 0:
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        found = self._allocations.get(key)
        return found if found is not None else self._allocations.setdefault(key, np.empty(shape, dtype))

    kernel.BlockManager.run = run
    kernel.BlockThread.syncthreads = syncthreads
    kernelapi.FakeCUDAShared.array = shared_array


_simulator_blocks_on_barriers()


@pytest.fixture(scope="session")
def tok():
    """A small tokenizer trained on prompts like the bundled instruction tasks."""
    from nanoeuler_core.training import sft
    from nanoeuler_core.inference.chat import render_prompt
    from nanoeuler_core.text.tokenizer import Tokenizer

    lines = sft.bundled_tasks().read_text(encoding="utf-8").splitlines()[:300]
    examples = [json.loads(line) for line in lines]
    return Tokenizer.train("".join(render_prompt(e["instruction"]) + e["output"] + "\n" for e in examples), 300)


# The slowest cases (simulated GPU kernels, 30 s to 2.5 min each, slowest first), which pytest-xdist
# would otherwise reach late and finish alone. Its work-stealing scheduler hands each of the two
# workers half of the list, in order: the slow cases go to the heads of both halves, alternately.
SLOW_FIRST = ("test_ops.py::test_op_gradcheck[attention-fp32]", "test_ops.py::test_op_gradcheck[attention-bf16]",
              "test_model.py::test_backend_gradients_match_reference[cuda]",
              "test_generate.py::test_captured_step_equals_the_cpu_in_fp32_and_bf16",
              "test_model.py::test_recompute_gives_the_same_gradients_bit_for_bit_on_cuda",
              "test_precision.py::test_bf16_model_gradients_within_bound_of_float32",
              "test_precision.py::test_bf16_updates_float32_master_weights_and_saves_float32",
              "test_ops.py::test_op_gradcheck[classifier-fp32]")


def pytest_collection_modifyitems(config, items):
    by_id = {item.nodeid.removeprefix("tests/"): item for item in items}
    slow = [by_id[name] for name in SLOW_FIRST if name in by_id]
    rest = [item for item in items if item not in slow]
    first, second = slow[0::2], slow[1::2]
    half = max(len(first), len(items) // 2)
    items[:] = first + rest[:half - len(first)] + second + rest[half - len(first):]
