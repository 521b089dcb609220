"""The SASS of the Triton kernels a run compiled, read from its Triton cache: registers, local memory, 128-bit
global loads, resident threads per SM and instructions per logit of rlkernels' kernels, one row per variant.

    TRITON_CACHE_DIR=/tmp/tc python -m benchmarks.report ...   # compiles what it launches into /tmp/tc
    python -m benchmarks.device_sass /tmp/tc [--json FILE]

`benchmarks.gpu_static` compiles every variant ahead of time with the Triton installed where it runs; this
reads what a machine's own Triton and ptxas built for the launches it made (gpu_check.sh: the device's
Triton 3.6, where gpu_static's numbers are another version's). Each cached variant is a folder holding
`<kernel>.cubin`, `<kernel>.json` (num_warps, shared memory, target) and `<kernel>.ttir` (the signature: the
first pointer's element type is the logits'). Registers, stack and local memory from `cuobjdump -res-usage`;
loads and the streaming loop from `cuobjdump -sass` (benchmarks/sass.py: instructions of the loop that loads
the most, per element loaded); threads per SM by benchmarks/occupancy.py. Kernels of other libraries in the
same cache (Liger's) are counted, not shown. Check: issue 23's limits (benchmarks/gpu_static.py) on a row
kernel of 16-bit logits that streams: ≥ 1536 threads per SM, ≤ 12 instructions per logit forward, 16 backward.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

from benchmarks import gpu_static, occupancy, sass

_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")
_POINTEE = re.compile(r"!tt\.ptr<(\w+)>")
_BITS = {"bf16": 16, "f16": 16, "f32": 32}


def rlkernels_kernels():
    """{kernel name: whether it streams rows of logits} of rlkernels' Triton kernels."""
    import importlib

    return {name: not gpu_static.is_elementwise(getattr(importlib.import_module(module), name))
            for module, name in gpu_static.triton_kernels()}


def read_variant(cubin, cuobjdump, row_kernel):
    """One row of a cached variant (`<dir>/<kernel>.cubin` beside its .json and .ttir)."""
    stem = cubin[:-len(".cubin")]
    with open(stem + ".json") as f:
        meta = json.load(f)
    with open(stem + ".ttir") as f:
        pointee = _POINTEE.search(f.read())
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    registers, stack, local = (int(x) for x in _USAGE.search(usage).groups())
    (function,) = sass.functions(cubin, cuobjdump).values()
    loads = function.loads()
    element = pointee.group(1) if pointee else "?"
    per_element = (function.instructions_per_element(_BITS[element])
                   if row_kernel and element in _BITS else None)
    arch = f"sm_{meta['target']['arch']}"
    block = meta["num_warps"] * 32
    try:
        threads = occupancy.threads_per_sm(arch, registers, meta.get("shared", 0), block)
    except KeyError:  # an arch occupancy.py does not know
        threads = None
    return dict(kernel=meta["name"], arch=arch, dtype=element, warps=meta["num_warps"], registers=registers,
                stack_bytes=stack, local_bytes=local, shared_bytes=meta.get("shared", 0), threads_per_sm=threads,
                loads_128=sum(bits >= 128 for bits in loads), widest_load=max(loads, default=0),
                instructions_per_element=per_element, variant=os.path.basename(os.path.dirname(cubin))[:8])


def check(row):
    """Issue 23's limits where they apply (a 16-bit streaming row kernel), else ''."""
    if row["instructions_per_element"] is None or row["dtype"] not in ("bf16", "f16"):
        return ""
    limit = gpu_static.TRITON_INSTRUCTIONS["backward" if "bwd" in row["kernel"] else "forward"]
    problems = [f"{row['instructions_per_element']:.1f} > {limit} instructions/logit"] * (
        row["instructions_per_element"] > limit)
    if row["threads_per_sm"] is not None and row["threads_per_sm"] < gpu_static.MIN_THREADS_PER_SM:
        problems.append(f"{row['threads_per_sm']} < {gpu_static.MIN_THREADS_PER_SM} threads/SM")
    if row["stack_bytes"] or row["local_bytes"]:
        problems.append("local memory")
    if not row["loads_128"]:
        problems.append("no 128-bit load")
    return "; ".join(problems) or "ok"


def rows(cache_dir, cuobjdump):
    """(rows of rlkernels' kernels, count of other kernels) in `cache_dir`."""
    ours = rlkernels_kernels()
    found, others = [], 0
    for cubin in sorted(glob.glob(os.path.join(cache_dir, "**", "*.cubin"), recursive=True)):
        name = os.path.basename(cubin)[:-len(".cubin")]
        if name not in ours:
            others += 1
            continue
        found.append(read_variant(cubin, cuobjdump, ours[name]))
    found.sort(key=lambda r: (r["kernel"], r["dtype"], r["warps"]))
    return found, others


def markdown(found):
    lines = ["| kernel | arch | logits | warps | registers | stack / local bytes | threads/SM | 128-bit loads "
             "| widest load | instructions/logit | check | variant |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in found:
        per = "-" if r["instructions_per_element"] is None else f"{r['instructions_per_element']:.1f}"
        lines.append(f"| {r['kernel']} | {r['arch']} | {r['dtype']} | {r['warps']} | {r['registers']} | "
                     f"{r['stack_bytes']} / {r['local_bytes']} | {r['threads_per_sm'] or '?'} | {r['loads_128']} | "
                     f"{r['widest_load']} bits | {per} | {check(r)} | {r['variant']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache_dir", help="a Triton cache folder (TRITON_CACHE_DIR of the run that compiled)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    cuobjdump = gpu_static.find_cuobjdump()
    if cuobjdump is None:
        print("device_sass: no cuobjdump (neither the CUDA toolkit's nor Triton's)")
        return 1
    found, others = rows(args.cache_dir, cuobjdump)
    import triton

    print(f"Triton {triton.__version__}, {cuobjdump}: {len(found)} variants of rlkernels' kernels in "
          f"{args.cache_dir} ({others} other kernels not shown)")
    print(markdown(found))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0 if found and all(check(r) in ("", "ok") for r in found) else 1


if __name__ == "__main__":
    sys.exit(main())
