"""nanoeuler-gelu's kernels for nanoeuler's CPU backend, one module per op (found by the op's name)."""
