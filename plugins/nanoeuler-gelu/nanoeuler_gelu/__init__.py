"""nanoeuler-gelu: GELU as a nanoeuler op, laid out as nanoeuler's own ops are: the op in
`gelu.py` (spec, float64 reference, registration), its CPU kernels in `cpu/gelu.py`."""
