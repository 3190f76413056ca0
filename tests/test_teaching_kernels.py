"""The teaching kernels (written to be read first; the model never runs them) against the float64
references, under the simulator or on a GPU."""

import numpy as np
import pytest
from numba import cuda

from nanoeuler_ops import attention as reference
from nanoeuler_ops.cuda.attention import teaching


@pytest.mark.parametrize("b, t, s, h, kv, d", [(1, 5, 9, 4, 2, 8),      # GQA, queries after a KV cache (S > T)
                                               (2, 33, 33, 2, 1, 4)])   # two tiles of rows and keys, the last partial
def test_teaching_attention_forward_matches_the_reference(b, t, s, h, kv, d):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, t, h, d), (b, s, kv, d), (b, s, kv, d)))
    o, (_, lse) = teaching.forward(*(cuda.to_device(x) for x in (q, k, v)))
    o_ref, (_, lse_ref) = reference.forward(*(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(o.copy_to_host(), o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.copy_to_host(), lse_ref, rtol=1e-5, atol=1e-5)
