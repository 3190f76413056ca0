"""Test setup: without a CUDA driver, run the CUDA backend on Numba's CUDA simulator, so the
registry-driven checks compare cpu and cuda everywhere (CI included). This must happen before
anything imports numba, hence here."""

import ctypes.util
import glob
import os


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None or bool(glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so*"))


if not _cuda_driver_present():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
