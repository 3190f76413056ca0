"""The instruction mix of the tensor-core attention kernels: for the forward, dq and dk/dv kernels
compiled for head size 64, the number of SASS instructions of each opcode (static counts: the
unrolled loop body once). Shows where a kernel's issue slots go besides HMMA and LDSM.

    python bench/attention_sass.py      # on a GPU machine (needs nvdisasm)
"""

import collections
import re

import numpy as np
from numba import cuda

from nanoeuler_ops.cuda import attention

OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def main() -> None:
    # compile the kernels for their argument types by running them once on small bf16 inputs
    q = cuda.to_device(np.zeros((2, 128, 4, 64), np.uint16))
    kv = cuda.to_device(np.zeros((2, 128, 2, 64), np.uint16))
    o, saved = attention.forward(q, kv, kv)
    attention.backward(o, saved, q, kv, kv)
    cuda.synchronize()
    kernels = attention.mma_kernels(64)
    for name in kernels._fields:
        for text in getattr(kernels, name).function.inspect_sass().values():
            opcodes = collections.Counter(m.group(1).split(".")[0] for m in OPCODE.finditer(text))
            top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(20))
            print(f"{name}: {sum(opcodes.values())} instructions; {top}")


if __name__ == "__main__":
    main()
