"""A package of extra kernels, as a third-party package would ship them for a backend it does not
own (registered under the entry-point group `nanoeuler.kernels`): rmsnorm for the minimal backend,
and a `linear` that the CPU backend must ignore (a backend's own kernels come first)."""
