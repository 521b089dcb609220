"""Every GPU kernel compiled ahead of time for sm_80 and sm_90, with no GPU: registers, local memory, vector loads,
occupancy and instructions per logit.

    python -m benchmarks.gpu_static [--arch sm_80 sm_90] [--backend triton|cuda] [--dtype fp32 bf16 fp16]
                                    [--quick] [--jobs N] [--triton-python PYTHON ...] [--out FILE] [--json FILE]

prints one markdown table (kernel, backend, arch, dtype, configuration, registers, stack and spill bytes,
128-bit global loads, widest global load, resident threads per SM, instructions per logit) and exits 1
when a Triton variant fails to compile twice (a failure is retried once, in a fresh pool; the other rows are
kept), a kernel uses local memory (a stack frame or spills), a streaming kernel issues no 128-bit global
load, or a streaming kernel misses issue 23's limits (below); the failures are named on stderr. --json
writes the rows as a list of objects whose keys are kernel, backend, arch, dtype, configuration,
registers, spill_bytes (stores + loads), threads_per_sm, instructions_per_element (null for a kernel
that does not stream a row), then the table's other columns.

Two kinds of kernel: row kernels stream a row of logits (V of them) in tiles; elementwise kernels
(policy_token_loss) take per-token fp32 scalars, one token per lane, and no logits. Both must be free of
local memory; only a row kernel that streams several tiles must have 128-bit loads (an elementwise
kernel's loads are per-token scalars: `ok (elementwise)`). An elementwise kernel's dtype column is `-`:
it does not depend on the logits' dtype, and is compiled once per arch whatever --dtype says.

Threads per SM: the threads of the blocks one SM holds at once, from the kernel's registers per thread,
its shared memory per block (Triton's `metadata.shared`; ptxas's report for CUDA) and its block size
(Triton's num_warps; a CUDA kernel's `__launch_bounds__`, at which its launcher launches it), against
sm_80's and sm_90's 65536 registers, 164 / 228 KB of shared memory, 2048 threads and 32 blocks
(benchmarks/occupancy.py, with the hardware's rounding).
Instructions per logit: the SASS instructions of the streaming loop over the logits one thread loads in
one iteration. The loop is found in `cuobjdump -sass`: a branch back to a lower address closes a loop,
and the streaming loop is the one that loads the most bytes (the shortest of those: a compiler's
versioned copies). Every instruction between its head and its back-edge counts, a branch taken rarely
(CUDA's rescale when a thread's max grows) in full; the logits per iteration are its global load bits
over the logit's bits, e.g. 2 × 128 / 16 = 16 for a Triton tile of 8192 bf16 logits over 512 threads
(benchmarks/sass.py). Null where no row is streamed (elementwise kernels, one-tile configurations).
Limits (issue 23), checked on the streaming row kernels of 16-bit logits on sm_90 compiled without the
final-logit cap: at least MIN_THREADS_PER_SM = 1536 threads per SM (CUDA and Triton), and at most
TRITON_INSTRUCTIONS = 12 instructions per logit in a Triton forward, 16 in a backward. A cap adds a tanh
per logit (some 20 instructions, and registers): its kernels are shown, not held to the limits. The split row
(two_pass=True on triton) is held to the forward's budget, its count being that of its gradient loop.

Triton: every `triton.JITFunction` named `*_kernel` in the modules of rlkernels/kernels/triton is compiled
by `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 80 | 90, 32))`.
The signature, the constexprs and the `tt.divisibility` attributes are made by Triton's own launch-time
specialisation (the binder and `_pack_args` of `JITFunction.run`, private: as in Triton 3.9) from stand-in
arguments of a typical launch: 16-byte-aligned tensors and V = row stride = a multiple of 16, as are T and
the batch stride (an elementwise kernel's n: 32768 tokens). Their types follow the launchers: logits and out in the logits'
dtype, targets int64, mask bool, every other row or token vector fp32, V, n and strides int, the other
scalars float. The row kernels align their tiles to 16 bytes themselves, so a row of odd length keeps
its 128-bit loads: each row kernel is compiled at the streaming configuration with V = 151937 too (V and
the stride not multiples of 16, rows not aligned; default flags). An elementwise kernel whose n is not a
multiple of 16 gets narrower loads (32-bit instead of 64-bit, same registers); that variant is not
compiled here. Triton builds sm_90 as sm_90a. A kernel is elementwise when it has neither a V argument
nor a BLOCK_V constexpr; its tile is the BLOCK constexpr.

Configurations, for fp32, bf16 and fp16: every (BLOCK_V, num_warps) that the module's `launch_config`
gives for V = 1, 2, 4, ..., 2^17 and 151936, compiled with the largest of those V that maps to it. Only
the configuration of long rows then has V > BLOCK_V: the row loop streams several tiles, and only there
are 128-bit loads required (a 128-logit tile over 128 threads is one logit per thread).
Compile-time flags: a kernel with at most 4 reachable flag combinations (NEED_ENTROPY, HAS_H) gets every
one at every configuration. HAS_CAP (the final-logit soft cap, a tanh per logit in the row loop) is off
everywhere and takes both values at the streaming configuration. `_policy_token_fwd_kernel` has 112
(objective × KL estimator × HAS_OLD × HAS_REF × bias correction, where a KL term needs ref log-probs and
bias correction needs a KL term): its default (GRPO's: clip, k3, old and ref log-probs) runs at every
configuration, and at the streaming configuration a greedy set of combinations takes every value of
every flag at least once. The flags change only the scalar loss after the row loop.
Elementwise kernels: one configuration, as their launcher launches it (policy_token_loss: BLOCK = LOSS_BLOCK = 256
tokens, Triton's default 4 warps; covariance_choice: one program of CHOICE_WARPS = 8 warps over BLOCK = CHOICE_BLOCK
= 1024 tokens a step), with no logits dtype. `_policy_token_loss_kernel`'s flags are the forward's plus
HAS_ENTROPY and HAS_ADV: 448 reachable combinations, of which the same greedy set (7: the default with
entropy and advantages, then every value of every flag once) is compiled; there the flags are the whole
kernel.

CUDA: every csrc/cuda/*.cu is compiled by nvcc with the real build's device flags; one row per kernel
instantiation, its configuration the template arguments named by the source's template parameters
(kThreads=512 kCap=false). `-fatbin` builds the device code only (the same cicc and ptxas runs as `-c`,
without the host compile that python_tests/test_cuda_compile.py checks). A kernel is classified by its
name: those in CUDA_ELEMENTWISE (policy_token_loss_kernel: one thread per token; covariance_choice_kernel:
one block over the tokens; no template, dtype `-`) are elementwise; every other one walks rows in 16-byte
packs (row_pass.cuh), so it must have 128-bit loads. The two-pass cluster kernel (CUDA_CLUSTER: two_pass_kernel,
policy_token_two_pass.cu) is sm_90's: on sm_80 it is a trap and has no row. Its launcher gives it dynamic shared
memory (a row's slice) and a cluster size by the row's length: its rows take those of V = 151936 (cluster_row.cuh's
plan(), run by a host program nvcc builds from the header), counted in its threads per SM, and its instructions per
logit are those of its load loop (phase 1) plus those of its store loop (phase 4, the slice's gradient from shared
memory). A second table gives, for it, the static and dynamic shared memory per block, the cluster size and the
128-bit global stores.

Registers, stack frame, spill and shared bytes come from ptxas's -v report (nvcc -Xptxas -v; Triton prints it
with knobs.nvidia.dump_ptxas_log, into a fresh cache so that ptxas runs for every variant); the loads and
the loop from `cuobjdump -sass` of the binary, a CUDA kernel's block from `cuobjdump -elf` (the CUDA
toolkit's cuobjdump, else the one in Triton's wheel). Triton is skipped, with a note, when it is not
importable; CUDA when nvcc or cuobjdump is missing. The whole sweep is 320 Triton variants (30 of them
elementwise) at 0.5-2 s each and one nvcc run per .cu file, the files in parallel (166 CUDA rows): 250 s
measured on 2 busy cores. --quick: the streaming configurations with every flag combination of a kernel that has
at most 4 (NEED_ENTROPY, HAS_H; else its default flags), their odd V and the elementwise kernels with their default
flags, and the nvcc runs: 30 s on 2 cores for sm_90 and bf16.

Triton versions: ptxas's registers are those of the Triton (and its bundled ptxas) that compiles, and they move
between versions (issue 38: the no-entropy forward took 61 registers under Triton 3.6, 40 under 3.9).
--triton-python PYTHON ...: each interpreter (a virtual environment with another Triton and torch, the project on
its PYTHONPATH) compiles the same Triton variants too, in its own process; every row names the Triton that
compiled it (the backend column, `triton 3.6.0`) and is held to the same checks. The table of the device's own
Triton is the one that counts for a run there; this one is how it is known before.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Optional

from benchmarks import occupancy, sass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("sm_80", "sm_90")
DTYPES = ("fp32", "bf16", "fp16")
TRITON_PACKAGE = "rlkernels.kernels.triton"
CUDA_SOURCES = os.path.join(ROOT, "csrc", "cuda", "*.cu")

# Every power of two reaches every tile size of a launch table; 151936 (Qwen's vocabulary) is the typical long row.
VOCABS = tuple(2 ** k for k in range(18)) + (151936,)

# Issue 23's limits on a kernel that streams rows of 16-bit logits on sm_90 (H100/H200) without a cap:
# the resident threads that keep enough loads in flight for the memory's bandwidth, and (Triton) the
# instructions per logit of the streaming loop that keep up with 4.3 TB/s. A cap adds a tanh per
# logit (some 20 instructions, and registers): its kernels are reported, not held to them.
LIMITED = {("sm_90", "bf16"), ("sm_90", "fp16")}
MIN_THREADS_PER_SM = 1536
TRITON_INSTRUCTIONS = {"forward": 12, "backward": 16}

# --- ptxas -v reports (shared with python_tests/test_cuda_compile.py) -------------------------------------

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")  # Triton's ptxas says sm_90a
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_entries(log):
    """[[kernel (mangled), arch, registers, stack, spill stores, spill loads, smem]] from a ptxas -v log."""
    rows, current = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = [m.group(1), m.group(2), None, 0, 0, 0, 0]
            rows.append(current)
        elif current is not None and (m := _SPILL.search(line)):
            current[3:6] = [int(g) for g in m.groups()]
        elif current is not None and (m := _REGS.search(line)):
            current[2] = int(m.group(1))
            current[6] = int(m.group(2) or 0)
    return rows


def demangle(names):
    """{mangled: demangled} (names unchanged without cu++filt or c++filt)."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return dict(zip(names, names))
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out if len(out) == len(names) else names))


def short_name(name):
    """rlk_cuda::(anonymous namespace)::fwd_kernel<float, 32, true, rlk_cuda::rows::StoreRow<true>>(...)
    → fwd_kernel<float, 32, true, StoreRow<true>>: the template arguments end at the `>` that
    closes the first `<` (the parameter list may hold more). A `(` before any `<` opens the parameter
    list of a kernel that is no template: policy_token_loss_kernel(long, ..., rlk::TokenLossParams<float>, ...)
    → policy_token_loss_kernel."""
    name = name.replace("(anonymous namespace)::", "")
    head, bracket, rest = name.partition("<")
    if not bracket or "(" in head:
        return name.split("(", 1)[0].rsplit("::", 1)[-1]
    depth = 1
    for end, ch in enumerate(rest):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if depth == 0:
            break
    return head.rsplit("::", 1)[-1] + "<" + re.sub(r"\w+::", "", rest[: end + 1])


def ptxas_report(log):
    """[(kernel, arch, registers, stack, spill stores, spill loads, smem)] from a ptxas -v log, names demangled."""
    rows = ptxas_entries(log)
    names = demangle(sorted({r[0] for r in rows}))
    return [(short_name(names[r[0]]), *r[1:]) for r in rows]


def torch_nvcc_flags():
    """The flags torch's CUDAExtension gives nvcc (no implicit half/bf16 conversions, ...)."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    except ImportError:
        COMMON_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                             "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                             "--expt-relaxed-constexpr"]
    return list(COMMON_NVCC_FLAGS)


def nvcc_flags():
    """The real build's device flags (torch's, -O3), with ptxas's report."""
    return ["-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v", "-I", os.path.join(ROOT, "csrc", "include"),
            *torch_nvcc_flags()]


def gencode(archs):
    return [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]


# --- cuobjdump -------------------------------------------------------------------------------------------


def find_cuobjdump():
    """The CUDA toolkit's cuobjdump, else the one in Triton's wheel; None without either."""
    path = shutil.which("cuobjdump")
    if path is None:
        with contextlib.suppress(ImportError):
            from triton import knobs
            path = knobs.nvidia.cuobjdump.path
    return path if path and os.access(path, os.X_OK) else None


# --- rows ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    kernel: str
    backend: str
    arch: str
    dtype: str
    config: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int  # bytes of shared memory per block
    block: int  # threads per block
    loads_128: int
    widest_load: int
    instructions_per_element: Optional[float]  # in the streaming loop (benchmarks/sass.py); None: no row streamed
    streaming: bool  # a row kernel streaming several tiles of a row: 128-bit loads required
    elementwise: bool = False  # per-token scalars, no logits: 128-bit loads not required
    capped: bool = False  # compiled with the final-logit cap (HAS_CAP, kCap)
    dynamic_shared: int = 0  # bytes per block its launcher asks at V = 151936 (the cluster kernel's slice)
    cluster: int = 0  # blocks per thread-block cluster at V = 151936 (0: not a cluster kernel)
    stores_128: int = 0  # 128-bit global stores
    triton: str = ""  # the version of the Triton that compiled a Triton row ("" for a CUDA one)

    @property
    def threads_per_sm(self):
        return occupancy.threads_per_sm(self.arch, self.registers, self.shared + self.dynamic_shared, self.block)

    def limits(self):
        """(threads per SM at least, instructions per logit at most or None) that this row must meet, or None."""
        if not self.streaming or self.capped or (self.arch, self.dtype) not in LIMITED:
            return None
        per_element = None
        if self.backend == "triton":
            per_element = TRITON_INSTRUCTIONS["backward" if "bwd" in self.kernel else "forward"]
        return MIN_THREADS_PER_SM, per_element

    def problems(self):
        out = []
        if self.stack or self.spill_stores or self.spill_loads:
            out.append(f"local memory: {self.stack} B stack frame, "
                       f"{self.spill_stores}/{self.spill_loads} B spill stores/loads")
        if self.streaming and not self.loads_128:
            out.append(f"streams the row without a 128-bit global load (widest: {self.widest_load} bits)")
        if limits := self.limits():
            threads, per_element = limits
            if self.threads_per_sm < threads:
                out.append(f"{self.threads_per_sm} threads per SM, fewer than {threads}")
            if per_element is not None and self.instructions_per_element > per_element:
                out.append(f"{self.instructions_per_element:.1f} instructions per logit, more than {per_element}")
        return out

    def to_json(self):
        """The row under the names of the JSON output (the keys of issue 23 first)."""
        return {"kernel": self.kernel, "backend": self.backend, "arch": self.arch, "dtype": self.dtype,
                "configuration": self.config, "registers": self.registers,
                "spill_bytes": self.spill_stores + self.spill_loads, "threads_per_sm": self.threads_per_sm,
                "instructions_per_element": self.instructions_per_element,
                "stack_bytes": self.stack, "spill_stores": self.spill_stores, "spill_loads": self.spill_loads,
                "shared_bytes": self.shared, "block_threads": self.block, "loads_128": self.loads_128,
                "widest_load": self.widest_load, "streaming": self.streaming, "elementwise": self.elementwise,
                "capped": self.capped, "dynamic_shared_bytes": self.dynamic_shared, "cluster": self.cluster,
                "stores_128": self.stores_128, "triton": self.triton, "problems": self.problems()}

    @classmethod
    def from_json(cls, row):
        names = {"configuration": "config", "stack_bytes": "stack", "shared_bytes": "shared", "block_threads": "block",
                 "dynamic_shared_bytes": "dynamic_shared"}
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{names.get(k, k): v for k, v in row.items() if names.get(k, k) in fields})


def _per_element(r):
    return "-" if r.instructions_per_element is None else f"{r.instructions_per_element:.1f}"


def _backend(r):
    return f"{r.backend} {r.triton}" if r.triton else r.backend


def markdown(rows):
    lines = ["| kernel | backend | arch | dtype | configuration | registers | stack bytes | spill bytes (st/ld) "
             "| 128-bit loads | widest load | threads/SM | instructions/logit | check |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        check = "; ".join(r.problems()) or ("ok" if r.streaming else "ok (elementwise)" if r.elementwise
                                            else "ok (one tile)")
        lines.append(f"| {r.kernel} | {_backend(r)} | {r.arch} | {r.dtype} | {r.config} | {r.registers} | {r.stack} "
                     f"| {r.spill_stores}/{r.spill_loads} | {r.loads_128} | {r.widest_load} bits "
                     f"| {r.threads_per_sm} | {_per_element(r)} | {check} |")
    return "\n".join(lines)


def cluster_markdown(rows):
    """The cluster kernels' shared memory, cluster size and 128-bit stores at V = 151936 ("" without one)."""
    clustered = [r for r in rows if r.cluster]
    if not clustered:
        return ""
    lines = ["| kernel | arch | dtype | configuration | registers | static smem (B) | dynamic smem (B) | cluster "
             "| threads/SM | 128-bit loads | 128-bit stores | instructions/logit (load + store loop) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in clustered:
        lines.append(f"| {r.kernel} | {r.arch} | {r.dtype} | {r.config} | {r.registers} | {r.shared} "
                     f"| {r.dynamic_shared} | {r.cluster} | {r.threads_per_sm} | {r.loads_128} | {r.stores_128} "
                     f"| {_per_element(r)} |")
    return "\n".join(lines)


_ELEMENT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}


def _row(kernel, backend, arch, dtype, config, entry, shared, block, function, streaming, elementwise, capped,
         plan=None):
    """A Row from ptxas's entry [name, arch, registers, stack, spill stores, spill loads, smem] and the SASS;
    `plan`: a cluster kernel's (cluster size, dynamic shared bytes) at V = 151936, whose instructions per logit
    are its load loop's and its store loop's."""
    loads = function.loads()
    per_element = function.instructions_per_element(_ELEMENT_BITS[dtype]) if streaming else None
    if plan is not None and per_element is not None:
        per_element += function.instructions_per_element(_ELEMENT_BITS[dtype], "STG") or 0.0
    cluster, dynamic = plan or (0, 0)
    return Row(kernel, backend, arch, dtype, config, entry[2], *entry[3:6], shared, block,
               sum(bits >= 128 for bits in loads), max(loads, default=0), per_element, streaming, elementwise, capped,
               dynamic, cluster, sum(bits >= 128 for bits in function.stores()))


# --- Triton ----------------------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Pointees other than the logits' dtype; every other row vector is fp32 in the launchers (_row_vector).
_POINTEES = {"targets_ptr": "int64", "mask_ptr": "bool", "sync_ptr": "int32", "grad_out_ptr": "float32",
             "assumed_ptr": "float64"}
_LOGITS_DTYPE = ("logits_ptr", "out_ptr")  # out: the logits themselves or empty_like(logits)
_FULL_PRODUCT = 4  # at most this many reachable flag combinations: all of them at every configuration
# Flags compiled with their default value everywhere and with every value at the streaming configuration
# only (the soft cap adds a tanh per logit to the row loop: its registers and loads matter where it streams).
_STREAMING_ONLY = {"HAS_CAP": "0"}
# An elementwise kernel (no BLOCK_V, no V: one token per lane) at its launch: BLOCK = its module's
# LOSS_BLOCK tokens, Triton's default 4 warps; n = the tokens of 8 rows of 4096, a multiple of 16 like V.
_ELEMENTWISE_WARPS, _ELEMENTWISE_TOKENS = 4, 8 * 4096
# {elementwise kernel: (its module's BLOCK constant, its warps constant; None: Triton's default)}
_ELEMENTWISE_LAUNCH = {"_policy_token_loss_kernel": ("LOSS_BLOCK", None), "_scale_grad_kernel": ("SCALE_BLOCK", None),
                       "_covariance_choice_kernel": ("CHOICE_BLOCK", "CHOICE_WARPS")}


def _flag_domains():
    """{constexpr: {label: value}}, the default (GRPO's launch) first; and the fixed constexprs."""
    from rlkernels.kernels import token_loss_params as P
    on_off = {"1": True, "0": False}
    domains = {
        "NEED_ENTROPY": on_off, "HAS_H": on_off, "HAS_OLD": on_off, "HAS_REF": on_off,
        "HAS_ENTROPY": on_off, "HAS_ADV": on_off,
        "HAS_CHOSEN": on_off, "HAS_IS_WEIGHTS": on_off,
        "OBJECTIVE": {e.name: e.id for e in P.OBJECTIVES},  # clip (GRPO's) first
        "CHOICE": {"clip_cov": P.CHOOSE_CLIP_COV, "kl_cov": P.CHOOSE_KL_COV},
        "KL": {"k3": P.KL_K3, "none": P.KL_NONE, **{e.name: e.id for e in P.KL_ESTIMATORS}},
        "BIAS_CORRECTION": {"0": False, "1": True},
        "HAS_CAP": {"0": False, "1": True},
        "HAS_BONUS": on_off,
    }
    # FRACTION: Clip-Cov's and KL-Cov's default; STATS and GRAD: the split row's one launch (on a GPU)
    return domains, {"NUM_STATS": P.NUM_STATS, "FRACTION": 2e-4, "STATS": True, "GRAD": True}


def _reachable(flags):
    """A KL term needs ref log-probs (losses/inputs.py); bias correction needs a KL term (ops/kernel_params.py);
    Clip-Cov and KL-Cov run in `policy_token_loss` only, the only objectives that read its chosen tokens."""
    kl_term = flags.get("KL", "none") != "none"
    if kl_term and flags.get("HAS_REF") == "0":
        return False
    covariance, chosen = flags.get("OBJECTIVE") in ("clip_cov", "kl_cov"), flags.get("HAS_CHOSEN")
    if (covariance and chosen is None) or (chosen == "1" and not covariance):
        return False
    return kl_term or flags.get("BIAS_CORRECTION") != "1"


def _cover(combos):
    """Greedy: combinations until every value of every flag is in one, starting from the default (combos[0])."""
    chosen, missing = [], {item for c in combos for item in c.items()}
    while missing:
        best = max(combos, key=lambda c: len(missing & set(c.items())))
        chosen.append(best)
        missing -= set(best.items())
    return chosen


def flag_plan(names):
    """(flag combinations at every configuration, at the streaming one) of a kernel's flag constexprs."""
    domains, _ = _flag_domains()
    unknown = [n for n in names if n not in domains]
    if unknown:
        raise KeyError(f"constexprs {unknown}: add their launch values to gpu_static._flag_domains")
    combos = [dict(zip(names, labels)) for labels in itertools.product(*(domains[n] for n in names))]
    combos = [c for c in combos if _reachable(c)]
    everywhere = [c for c in combos if all(c.get(n, d) == d for n, d in _STREAMING_ONLY.items())]
    if len(everywhere) <= _FULL_PRODUCT:
        return everywhere, combos
    return everywhere[:1], _cover(combos)


def triton_kernels():
    """[(module, kernel name)]: the JIT kernels of the package's modules."""
    import pkgutil

    import triton
    package = importlib.import_module(TRITON_PACKAGE)
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{TRITON_PACKAGE}.{info.name}")
        found += [(module.__name__, name) for name, obj in vars(module).items()
                  if isinstance(obj, triton.JITFunction) and name.endswith("_kernel")
                  and obj.__module__ == module.__name__]
    if not found and triton.knobs.runtime.interpret:
        raise RuntimeError("the kernels were decorated under TRITON_INTERPRET=1: run this in a process without it")
    return found


def is_elementwise(fn):
    """A kernel over per-token scalars: it has no row length V and no BLOCK_V tile (its tile is BLOCK tokens)."""
    return "BLOCK_V" not in fn.arg_names and "V" not in fn.arg_names


def launch_table(module, dtype):
    """{(BLOCK_V, num_warps): the largest V of VOCABS that the module's launch_config gives it}."""
    import torch
    table = {}
    for vocab in sorted(VOCABS):
        table[module.launch_config(vocab, getattr(torch, _TORCH_DTYPES[dtype]), interpret=False)] = vocab
    return table


@dataclasses.dataclass(frozen=True)
class TritonJob:
    module: str
    kernel: str
    arch: str
    dtype: str  # the logits' dtype; "-" for an elementwise kernel (fp32 inputs whatever the logits')
    size: int  # V, or n (tokens) for an elementwise kernel
    block: int  # BLOCK_V, or BLOCK
    num_warps: int
    flags: tuple  # ((constexpr, label), ...)
    elementwise: bool = False

    @property
    def streaming(self):
        return not self.elementwise and self.size > self.block

    @property
    def config(self):
        flags = " ".join(f"{n}={label}" for n, label in self.flags)
        size, block = ("n", "BLOCK") if self.elementwise else ("V", "BLOCK_V")
        return f"{size}={self.size} {block}={self.block} warps={self.num_warps} {flags}".rstrip()


def triton_jobs(archs, dtypes, quick=False):
    """Every variant to compile (quick: the streaming configuration with every flag combination of a kernel that has
    at most _FULL_PRODUCT, else its default ones; an elementwise kernel's one configuration, default flags)."""
    jobs = []
    _, fixed = _flag_domains()
    for module_name, name in triton_kernels():
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        names = [p.name for p in fn.params if p.is_constexpr and p.name not in ("BLOCK_V", "BLOCK", "CHUNKS_P2")
                 and p.name not in fixed]
        everywhere, streaming = flag_plan(names)
        if is_elementwise(fn):  # one configuration, in no logits dtype: every flag value once (the cover)
            if "BLOCK" not in fn.arg_names:
                raise KeyError(f"{name}: an elementwise kernel (no V, no BLOCK_V) without a BLOCK constexpr")
            block, warps = _ELEMENTWISE_LAUNCH[name]
            block, warps = getattr(module, block), getattr(module, warps) if warps else _ELEMENTWISE_WARPS
            for arch in archs:
                for flags in everywhere[:1] if quick else streaming:
                    jobs.append(TritonJob(module_name, name, arch, "-", _ELEMENTWISE_TOKENS, block, warps,
                                          tuple(flags.items()), elementwise=True))
            continue
        for arch, dtype in itertools.product(archs, dtypes):
            table = launch_table(module, dtype)
            for (block, warps), vocab in table.items():
                long_rows = vocab > block
                if quick:
                    flag_sets = everywhere if long_rows else []  # every combination, or the default (flag_plan)
                else:
                    flag_sets = streaming if long_rows else everywhere
                for flags in flag_sets:
                    jobs.append(TritonJob(module_name, name, arch, dtype, vocab, block, warps, tuple(flags.items())))
                if long_rows:  # rows of odd length, not 16-byte aligned: the whole tiles keep their 128-bit loads
                    jobs.append(TritonJob(module_name, name, arch, dtype, vocab + 1, block, warps,
                                          tuple(everywhere[0].items())))
    return jobs


class _Rows:
    """A stand-in tensor for Triton's specialisation: its dtype, and a 16-byte-aligned address."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        return 1 << 20


def _stand_in(name, logits_dtype, size):
    import torch
    if name.endswith("_ptr"):
        return _Rows(logits_dtype if name in _LOGITS_DTYPE else getattr(torch, _POINTEES.get(name, "float32")))
    if name == "first_batch":
        return 0  # the first launch of a grid (the grid's y holds 65535 sequences)
    if name in ("V", "n", "seq_len") or name.startswith("stride"):
        return size  # contiguous rows (T = V rows per sequence); n: the tokens of an elementwise kernel
    if name in ("chunk", "chunks"):  # the split row's, as its launcher plans them
        from rlkernels.kernels.triton.split_row import split_plan
        return split_plan(size, logits_dtype, interpret=False)[2 if name == "chunk" else 3]
    if name == "loss_params":  # the token loss's packed scalars, as TokenLossParams.packed() gives them
        from rlkernels.kernels.token_loss_params import NUM_PARAMS
        return (1.0,) * NUM_PARAMS
    return 1.0  # the launchers pass float() scalars: typed fp32, never specialised


def _init_worker(cache_dir):
    from triton import knobs
    knobs.cache.dir = cache_dir  # empty: ptxas runs, and reports, for every variant
    knobs.nvidia.dump_ptxas_log = True


def compile_triton(job, cuobjdump):
    """The Row of one variant: compiled for job.arch, read from ptxas's report and the cubin's SASS."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    module = importlib.import_module(job.module)
    fn = getattr(module, job.kernel)
    domains, fixed = _flag_domains()
    target = GPUTarget("cuda", int(job.arch[3:]), 32)
    backend = make_backend(target)
    dtype = getattr(torch, _TORCH_DTYPES.get(job.dtype, "float32"))  # "-": no logits
    args = [_stand_in(p.name, dtype, job.size) for p in fn.params if not p.is_constexpr]
    constexprs = {n: domains[n][label] for n, label in job.flags}
    if "CHUNKS_P2" in fn.arg_names:  # the split row's chunks per row, rounded up to a power of two
        constexprs["CHUNKS_P2"] = triton.next_power_of_2(_stand_in("chunks", dtype, job.size))
    kwargs = {**constexprs, **{n: v for n, v in fixed.items() if n in fn.arg_names},
              "BLOCK" if job.elementwise else "BLOCK_V": job.block, "num_warps": job.num_warps}
    if hasattr(module, "register_cap"):  # a launch option of that module's kernel (split_row.py)
        cap = module.register_cap(dict(job.flags).get("HAS_CAP") == "1")
        if cap is not None:
            kwargs["maxnreg"] = cap
    # What JITFunction.run does at a launch: bind, specialise (types, tt.divisibility), pack.
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # dump_ptxas_log prints the report
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    (entry,) = ptxas_entries(log.getvalue())
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        (function,) = sass.functions(cubin.name, cuobjdump).values()
    row = _row(job.kernel, "triton", job.arch, job.dtype, job.config, entry, compiled.metadata.shared,
               compiled.metadata.num_warps * 32, function, job.streaming, job.elementwise,
               dict(job.flags).get("HAS_CAP") == "1")
    return dataclasses.replace(row, triton=triton.__version__)


def _compile_job(job_and_tool):
    job, cuobjdump = job_and_tool
    try:
        return compile_triton(job, cuobjdump)
    except Exception as e:  # name the variant: the worker's traceback does not
        raise RuntimeError(f"{job.kernel} {job.arch} {job.dtype} {job.config}: {e}") from e


def triton_rows(jobs, cuobjdump, workers, attempts=2):
    """(rows in the jobs' order, [(job, error)] of the jobs that failed every attempt). A job that raises, or whose
    worker died (a killed process breaks the whole pool), is compiled again in a fresh pool, up to `attempts` times
    in all: one transient failure costs that job a retry, not the sweep its rows."""
    done, pending, errors = {}, list(enumerate(jobs)), {}
    for _ in range(attempts):
        if not pending:
            break
        with (tempfile.TemporaryDirectory(prefix="gpu_static_triton_") as cache,
              ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(cache,)) as pool):
            futures = [(i, job, pool.submit(_compile_job, (job, cuobjdump))) for i, job in pending]
            pending = []
            for i, job, future in futures:
                try:
                    done[i] = future.result()
                except Exception as e:  # noqa: BLE001 - any failure of one job is that job's
                    errors[i] = e
                    pending.append((i, job))
    return [done[i] for i in sorted(done)], [(job, errors[i]) for i, job in pending]


# --- CUDA ------------------------------------------------------------------------------------------------

_CUDA_DTYPES = {"float": "fp32", "__nv_bfloat16": "bf16", "__half": "fp16"}
# Kernels over per-token scalars (one thread per token, no logits), by name: no 128-bit loads required.
# Every other kernel walks rows of logits in 16-byte packs (row_pass.cuh) and must have them.
CUDA_ELEMENTWISE = frozenset({"policy_token_loss_kernel", "covariance_choice_kernel"})
# The two-pass kernel: a thread-block cluster per row, sm_90 only (a trap on sm_80, no row there).
CUDA_CLUSTER = frozenset({"two_pass_kernel"})
CLUSTER_VOCAB = 151936

_PLAN_PROGRAM = """#include <cstdio>
#include "cluster_row.cuh"
int main() {
  for (int bytes : {4, 2}) {
    const rlk_cuda::cluster::Plan p = rlk_cuda::cluster::plan(%d, bytes);
    std::printf("%%d %%d %%lld\\n", bytes, p.cluster, static_cast<long long>(p.slice_bytes));
  }
}
"""


def cluster_plans(out_dir):
    """{dtype: (cluster size, dynamic shared bytes)} the two-pass kernel's launcher takes at V = CLUSTER_VOCAB: the
    header's own plan(), built into a host program."""
    src, exe = os.path.join(out_dir, "plan.cu"), os.path.join(out_dir, "plan")
    with open(src, "w") as f:
        f.write(_PLAN_PROGRAM % CLUSTER_VOCAB)
    subprocess.run([shutil.which("nvcc"), "-std=c++17", "-I", os.path.join(ROOT, "csrc", "include"), "-I",
                    os.path.join(ROOT, "csrc", "cuda"), src, "-o", exe], check=True, capture_output=True, text=True)
    out = {}
    for line in subprocess.run([exe], check=True, capture_output=True, text=True).stdout.splitlines():
        size, cluster, dynamic = (int(x) for x in line.split())
        for dtype in (["fp32"] if size == 4 else ["bf16", "fp16"]):
            out[dtype] = (cluster, dynamic)
    return out


def _template_args(name):
    """fwd_kernel<float, 32, true, rows::StoreRow<true> > → ("fwd_kernel", ["float", "32", "true", "rows::StoreRow<true>"])"""
    head, _, tail = name.partition("<")
    args, depth, current = [], 0, ""
    for ch in tail.rstrip()[:-1]:
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
            continue
        depth += (ch == "<") - (ch == ">")
        current += ch
    if current.strip():
        args.append(current.strip())
    return head, args


# `template <typename T, int kThreads, bool kCap> __global__ void __launch_bounds__(...) bwd_kernel(`
_KERNEL_TEMPLATE = re.compile(r"template\s*<([^<>]*)>\s*__global__\s+void\s+"
                              r"(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")


def template_params(text):
    """{kernel: [its template parameters' names]} of the __global__ function templates of a .cu source."""
    return {m.group(2): [p.split()[-1] for p in m.group(1).split(",")] for m in _KERNEL_TEMPLATE.finditer(text)}


def cuda_rows(archs, cuobjdump, out_dir):
    """A Row per kernel instantiation per arch of every csrc/cuda/*.cu (one nvcc run per file, all at once)."""
    nvcc = shutil.which("nvcc")

    def build(source):
        fatbin = os.path.join(out_dir, os.path.basename(source) + ".fatbin")
        cmd = [nvcc, "-fatbin", *gencode(archs), "--threads", str(len(archs)), *nvcc_flags(), source, "-o", fatbin]
        return fatbin, cmd, subprocess.run(cmd, capture_output=True, text=True)

    sources = sorted(glob.glob(CUDA_SOURCES))
    with ThreadPoolExecutor(max(len(sources), 1) + 1) as pool:
        plans = pool.submit(cluster_plans, out_dir)
        builds = list(pool.map(build, sources))
        plans = plans.result()
    rows = []
    for source, (fatbin, cmd, proc) in zip(sources, builds):
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
        with open(source) as f:
            params = template_params(f.read())
        functions = sass.functions(fatbin, cuobjdump)
        blocks = sass.max_threads(fatbin, cuobjdump)
        entries = ptxas_entries(proc.stderr)
        names = demangle(sorted({e[0] for e in entries}))
        for entry in entries:
            mangled, arch = entry[:2]
            kernel, targs = _template_args(short_name(names[mangled]))
            dtype = _CUDA_DTYPES.get(targs[0], "-") if targs else "-"
            if len(params.get(kernel, ())) != len(targs):
                raise RuntimeError(f"{kernel}: its template parameters were not found in {source}")
            named = dict(zip(params.get(kernel, ()), targs))
            # The first, the logits' type, is the dtype column.
            config = " ".join(f"{name}={arg}" for name, arg in list(named.items())[dtype != "-":])
            if (mangled, arch) not in blocks:
                raise RuntimeError(f"{kernel}: no __launch_bounds__, so no block size for its occupancy")
            if kernel in CUDA_CLUSTER and arch != "sm_90":
                continue
            elementwise = kernel in CUDA_ELEMENTWISE
            rows.append(_row(kernel, "cuda", arch, dtype, config, entry, entry[6], blocks[(mangled, arch)],
                             functions[(mangled, arch)], not elementwise, elementwise, named.get("kCap") == "true",
                             plans[dtype] if kernel in CUDA_CLUSTER else None))
    return rows


# --- command line ----------------------------------------------------------------------------------------


def other_triton_rows(python, args):
    """(rows, notes) of the same Triton variants compiled by another interpreter's Triton (`--triton-python`): this
    module run there with --backend triton, the project first on its path; a run that brings back no rows is a
    FAILED note."""
    cmd = [python, "-m", "benchmarks.gpu_static", "--backend", "triton", "--arch", *args.arch, "--dtype", *args.dtype,
           "--jobs", str(args.jobs), *(["--quick"] if args.quick else [])]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="gpu_static_other_") as out:
        path = os.path.join(out, "rows.json")
        proc = subprocess.run([*cmd, "--json", path], cwd=ROOT, env=env, capture_output=True, text=True)
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [Row.from_json(r) for r in json.load(f)]
    # Its own compile failures; the rows' problems are checked here again.
    notes = [line[len("FAIL "):] for line in proc.stderr.splitlines() if line.startswith("FAIL FAILED")]
    if not rows:
        notes.append(f"FAILED: {python} compiled no Triton row (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return rows, notes


def _triton_missing():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    return None


def toolchain(argv: Optional[list]) -> str:
    """One line naming what compiled the table (a table is only comparable to one from the same toolchain)."""
    import triton

    nvcc = "no nvcc"
    if shutil.which("nvcc"):
        version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        nvcc = next((line.strip() for line in version if "release" in line), "nvcc (version unknown)")
    command = " ".join(["python -m benchmarks.gpu_static", *(sys.argv[1:] if argv is None else argv)])
    return (f"Compiled {time.strftime('%Y-%m-%d')} by `{command}`: Triton {triton.__version__} (its bundled ptxas, "
            f"the Triton rows), {nvcc} (the CUDA rows), torch {_torch_version()}.")


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_static", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--backend", choices=("triton", "cuda"), help="only this backend (default: both)")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--quick", action="store_true",
                        help="Triton: only the streaming configuration (an elementwise kernel: its one) "
                             "with the default flags")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Triton compiles in parallel")
    parser.add_argument("--triton-python", nargs="+", default=[], metavar="PYTHON",
                        help="also compile the Triton rows with the Triton of each of these interpreters (another "
                             "version's virtual environment, with torch)")
    parser.add_argument("--out", help="also write the table (and notes) to this file")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    # Compiling needs the JIT kernels: under TRITON_INTERPRET=1 the kernels are decorated for the interpreter.
    os.environ.pop("TRITON_INTERPRET", None)

    start = time.monotonic()
    rows, notes = [], []
    cuobjdump = find_cuobjdump()
    # Imported before the nvcc thread starts: it and the Triton jobs both import torch, and two
    # threads importing torch at once can fail ("partially initialized module").
    import torch  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="gpu_static_nvcc_") as out_dir, ThreadPoolExecutor(1) as side:
        cuda = None
        if args.backend in (None, "cuda"):
            if shutil.which("nvcc") is None:
                notes.append("CUDA skipped: nvcc is not on PATH")
            elif cuobjdump is None:
                notes.append("CUDA skipped: no cuobjdump (neither the CUDA toolkit's nor triton's)")
            else:  # nvcc runs while Triton compiles
                cuda = side.submit(cuda_rows, args.arch, cuobjdump, out_dir)
        if args.backend in (None, "triton"):
            missing = _triton_missing() or (None if cuobjdump else "no cuobjdump (neither the CUDA toolkit's nor triton's)")
            if missing:
                notes.append(f"Triton skipped: {missing}")
            else:
                triton, failed_jobs = triton_rows(triton_jobs(args.arch, args.dtype, args.quick), cuobjdump, args.jobs)
                rows += triton
                notes += [f"FAILED to compile (twice): {job.kernel} {job.arch} {job.dtype} {job.config}: {error}"
                          for job, error in failed_jobs]
        if args.backend in (None, "triton"):
            for python in args.triton_python:
                other, other_notes = other_triton_rows(python, args)
                rows += other
                notes += other_notes
        if cuda is not None:
            rows += [r for r in cuda.result() if r.dtype in args.dtype or r.dtype == "-"]

    if any(not (r.streaming or r.elementwise) for r in rows):
        notes.append("One tile: V ≤ BLOCK_V, the row is not streamed; 128-bit loads are required of streaming "
                     "configurations only.")
    if any(r.elementwise for r in rows):
        notes.append("Elementwise: per-token fp32 scalars (no logits, dtype -), one token per lane; compiled for "
                     "registers and local memory, without a 128-bit load requirement.")
    clusters = cluster_markdown(rows)
    if clusters:
        notes.insert(0, f"Cluster kernels at V = {CLUSTER_VOCAB} (dynamic shared memory: the row's slice per block, "
                        f"counted in threads/SM; instructions per logit: load loop + store loop):\n\n{clusters}")
    versions = sorted({r.triton for r in rows if r.triton})
    text = toolchain(argv) + (f" Triton rows by Triton {', '.join(versions)}." if len(versions) > 1 else "")
    text += "\n\n" + markdown(rows) + "".join(f"\n\n{n}" for n in notes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in rows], f, indent=1)
    failures = [f"{r.kernel} ({_backend(r)} {r.arch} {r.dtype} {r.config}): {p}" for r in rows for p in r.problems()]
    failures += [n for n in notes if n.startswith("FAILED")]
    print(f"gpu_static: {len(rows)} kernels in {time.monotonic() - start:.0f} s, {len(failures)} failures",
          file=sys.stderr)
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
