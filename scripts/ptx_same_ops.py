#!/usr/bin/env python3
"""Checks that a refactor of a CUDA kernel file kept every kernel's arithmetic: same float ops,
loads, stores, shuffles, barriers, atomics and tensor-core ops, in the same order.

No GPU needed, only nvcc (../shared/cuda/env.sh). Compile the file before and after the change to
PTX and compare:
    git show BASE:kernels/decode.cu > /tmp/old/decode.cu   # plus the headers it includes
    nvcc -ptx -O3 -std=c++17 -arch=compute_90 -o old.ptx /tmp/old/decode.cu
    nvcc -ptx -O3 -std=c++17 -arch=compute_90 -o new.ptx kernels/decode.cu
    python3 scripts/ptx_same_ops.py old.ptx new.ptx
Registers, register moves and integer address arithmetic are left out of the comparison (moving
code into inlined device functions renumbers registers and may compute a shared-memory address
in 32 instead of 64 bits); everything that produces or moves a value is compared. Equal sequences
mean the same arithmetic in the same order; ptxas may still schedule the machine code
differently, so a GPU run of tests/it/attn_decode.rs remains the final word. Exit status 1 when a
kernel differs or is missing.
"""
import difflib
import re
import sys

KEPT = ("ld.", "st.", "mma", "ex2", "shfl", "bar", "atom", "ldmatrix", "cp.async", "fma", "rcp",
        "sqrt", "lg2", "red.", "prefetch")


def kernels(path):
    text = open(path).read()
    out = {}
    for part in re.split(r"\n(?=\.visible \.entry )", text)[1:]:
        name = re.match(r"\.visible \.entry (\w+)", part).group(1)
        ops = []
        for line in part.split("\n"):
            line = line.strip()
            if not line or line.startswith(("//", ".")):
                continue
            op = line.split()[0]
            if op.startswith("mov"):
                continue
            if re.search(r"\.(f16|bf16|f16x2|bf16x2|f32|f64)\b", op) or op.startswith(KEPT):
                line = re.sub(r"%[a-z]+\d+", "%", line)
                line = re.sub(r"\[[^\]]*\]", "[addr]", line)
                ops.append(line)
        out[name] = ops
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    bad = [k for k in old if old[k] != new.get(k)]
    extra = [k for k in new if k not in old]
    print(f"{len(old)} kernels; {len(old) - len(bad)} with the same op sequence")
    for k in bad[:3]:
        print(f"differs: {k}")
        diff = difflib.unified_diff(old[k], new.get(k, []), lineterm="", n=1)
        print("\n".join(list(diff)[:30]))
    if extra:
        print(f"new kernels: {extra}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
