"""Numba's on-disk kernel cache, kept true to the sources a kernel is built from.

Numba checks a cached kernel against its own file only, yet a kernel compiles in the device
functions and constants of the modules it imports (ops/cpu/lanes.py into every quantized CPU
product, ops/cuda/ptx.py into every CUDA kernel): edit one of those and Numba would keep loading
the old machine code. Here every cache locator's stamp also covers the modules beside the kernel's
file and those of each enclosing package folder (not their subfolders), so an edit to any of them
recompiles the kernels that may depend on it, once."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.cache
def folders_stamp(py_file: str) -> str:
    """A digest of every .py file in py_file's folder and in each enclosing package folder."""
    digest = hashlib.sha256()
    folder = Path(py_file).resolve().parent
    while True:
        for source in sorted(folder.glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        if not (folder.parent / "__init__.py").exists():
            return digest.hexdigest()
        folder = folder.parent


def stamp_sources(cache_impl) -> None:
    """Make the locators of `cache_impl` (a Numba CacheImpl class: the CPU's or the CUDA target's)
    stamp a cached kernel with folders_stamp as well as its own file. Idempotent."""
    if getattr(cache_impl, "stamps_folders", False):
        return

    def stamped(locator):
        def get_source_stamp(self):
            own = locator.get_source_stamp(self)
            path = getattr(self, "_py_file", None)
            return own if path is None else (own, folders_stamp(path))
        return type(locator.__name__, (locator,), {"get_source_stamp": get_source_stamp, "__module__": __name__})

    cache_impl._locator_classes = [stamped(locator) for locator in cache_impl._locator_classes]
    cache_impl.stamps_folders = True
