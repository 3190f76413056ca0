"""The instruction mix of the tensor-core attention kernels: for the forward, dq and dk/dv kernels
compiled for one head size and Hopper (sm_90a, as Numba builds for it), the registers each takes,
then the number of SASS instructions of each opcode, over the whole kernel and over its main loop
(the body of the loop that streams tiles, the unrolled code run once per tile). Shows where a
kernel's issue slots go besides the tensor-core instructions (HMMA, HGMMA) and LDSM. Needs no GPU:
Numba writes the PTX, ptxas assembles it and nvdisasm lists it (both on PATH; `pip install
nvidia-cuda-nvdisasm` brings nvdisasm).

    python bench/attention_sass.py [--head-size 64] [--keep DIR]
"""

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

from numba.cuda import compile_ptx

from nanoeuler_ops.cuda import attention
from nanoeuler_ops.cuda.attention import mma

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)")
LABEL = re.compile(r"^(\.L_x_\d+):")


def sass(name: str, kernel, folder: Path) -> tuple[str, str]:
    """(ptxas's report, the disassembly) of one kernel compiled as the backend compiles it."""
    options = kernel.targetoptions
    ptx, _ = compile_ptx(kernel.py_func, mma.mma_signatures()[name], cc=(9, 0, "a"), fastmath=options.get("fastmath", False))
    (folder / f"{name}.ptx").write_text(ptx)
    cap = ["-maxrregcount", str(options["max_registers"])] if "max_registers" in options else []
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-O3", "-v", *cap, f"{name}.ptx", "-o", f"{name}.cubin"],
                            cwd=folder, capture_output=True, text=True, check=True).stderr
    listing = subprocess.run(["nvdisasm", "-c", f"{name}.cubin"], cwd=folder, capture_output=True, text=True,
                             check=True).stdout
    (folder / f"{name}.sass").write_text(listing)
    return report, listing


def main_loop(listing: str) -> list[str]:
    """The opcodes of the longest backward branch's body that holds a tensor-core product: the tile loop."""
    labels, opcodes = {}, []
    for line in listing.splitlines():
        if found := LABEL.match(line):
            labels[found.group(1)] = len(opcodes)
        elif found := INSTRUCTION.search(line):
            opcodes.append((found.group(1).split(".")[0], found.group(2)))
    loops = []
    for end, (opcode, operands) in enumerate(opcodes):
        target = re.search(r"\((\.L_x_\d+)\)", operands) if opcode == "BRA" else None
        if target and labels.get(target.group(1), end) < end:
            body = [op for op, _ in opcodes[labels[target.group(1)]:end + 1]]
            if "HMMA" in body or "HGMMA" in body:
                loops.append(body)
    return max(loops, key=len, default=[])


def mix(opcodes) -> str:
    counts = collections.Counter(opcodes)
    return f"{sum(counts.values())} instructions; " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--keep", type=Path, help="keep the PTX, cubin and SASS files in this folder")
    args = parser.parse_args()
    kernels = attention.tensor_core_kernels(args.head_size, hopper=True)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for name in kernels._fields:
            report, listing = sass(name, getattr(kernels, name).function, folder)
            registers = re.search(r"Used (\d+) registers", report).group(1)
            spilled = re.search(r"(\d+) bytes spill stores", report).group(1)
            print(f"{name}: {registers} registers, {spilled} bytes spilled")
            print(f"  kernel: {mix(m.group(1).split('.')[0] for m in INSTRUCTION.finditer(listing))}")
            print(f"  loop:   {mix(main_loop(listing))}")


if __name__ == "__main__":
    main()
