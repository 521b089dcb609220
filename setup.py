"""Build of rlkernels and its optional compiled extension `rlkernels._C` (docs/design.md §6).

    pip install --no-build-isolation -e .                 # with the extension (needs torch installed)
    RLKERNELS_NO_EXTENSION=1 pip install ... -e .         # pure Python; the `torch` backend serves CPU
    RLKERNELS_CPU_ISA=auto|avx2|avx512|default            # vector ISA of the CPU kernels, see below
    RLKERNELS_NO_CUDA=1 pip install ... -e .              # CPU kernels only, even with a CUDA torch and nvcc

Package metadata is in pyproject.toml; this file only adds the extension. `--no-build-isolation`
matters: an isolated build would fetch another torch, and the extension must match the installed one.

`_C` = csrc/cpu/*.cpp (CppExtension, -O3, OpenMP), plus csrc/cuda/*.cu and csrc/cuda/*.cpp (the
torch bindings of the CUDA kernels; CUDAExtension) when this torch is a CUDA build and nvcc is found.
The GPU architectures are torch's choice: TORCH_CUDA_ARCH_LIST, else those of the visible GPUs; with neither (a CUDA
torch and nvcc on a machine without a GPU) the build is CPU-only and its line says why (`_cuda_archs`), where
torch would fail with a bare IndexError. One translation unit per op file keeps the build short; the build
prints one line saying what it compiles, with or without CUDA and why, and about how long that takes
(COMPILE_SECONDS); pip shows it, and ninja's progress, with `pip install -v`.
An isolated build (pip without --no-build-isolation) has no torch: it stops with an error saying so, rather
than install without the extension.
Objects go to build/temp-<platform>-<python>/ whatever the command (pip's editable install would use a temporary
folder), so ninja recompiles only what changed, and a wheel built after `pip install -e .` reuses the objects.

Vector ISA of the CPU kernels (RLKERNELS_CPU_ISA). at::vec picks its implementation when the
kernel is compiled, from the CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512 macros and the matching
-m flags; without them Vectorized<float> is a plain array loop that runs several times slower.
PyTorch itself compiles each kernel once per ISA and dispatches at run time; setuptools cannot
give one file several sets of flags, and doing so would double the build, so we compile once:
  * auto (default): AVX2 + FMA + F16C on x86-64 Linux when the build machine has them (checked
    with torch's own CPU detection), the generic path otherwise. The usual install is an
    editable build on the machine that runs it.
  * avx2 / avx512: force that ISA (a wheel built for other machines). AVX-512 is opt-in only:
    our test machines lack it, so it is compiled but not run by CI.
  * default: the generic path (portable, slower).
The extension checks the CPU when imported and raises ImportError naming the ISA it needs;
rlkernels then reports that reason and falls back to the `torch` backend. Never -ffast-math:
logits may be -inf (masked vocabulary entries) and the kernels rely on IEEE inf semantics.
-ffp-contract=off: d = (z − m)·(1/τ) must round the same in the vector loops and in the scalar code
(the target), never contracted into the − log s that follows, so that forward and backward agree.
"""
from __future__ import annotations

import glob
import math
import os
import platform
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
ISA_FLAGS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ["-DCPU_CAPABILITY_AVX2"]),
    "avx512": (["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"],
               ["-DCPU_CAPABILITY_AVX512"]),
    "default": ([], []),
}
# core-seconds to compile one source file: .cpp measured (the 4 files: 114 s on an idle 2-core x86 with torch 2.13,
# 207 s at load 8; issue 33), .cu a rough guess (nvcc, one pass per GPU architecture)
COMPILE_SECONDS = {".cpp": 55, ".cu": 60}


def _cpu_isa(torch) -> str:
    requested = os.environ.get("RLKERNELS_CPU_ISA", "auto").lower()
    if requested not in ("auto", *ISA_FLAGS):
        raise ValueError(f"RLKERNELS_CPU_ISA: expected auto, {', '.join(ISA_FLAGS)}; got {requested!r}")
    x86_gcc = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
    if requested != "auto":
        if requested != "default" and not x86_gcc:
            raise ValueError(f"RLKERNELS_CPU_ISA={requested} needs x86-64 Linux")
        return requested
    if x86_gcc and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2"
    return "default"


def _nvcc(cpp_extension):
    """nvcc, if it exists: CUDA_HOME may be a runtime-only install that cannot compile."""
    home = cpp_extension.CUDA_HOME
    if home is not None and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_archs(torch, environ=os.environ):
    """(the GPU architectures nvcc would compile for, as torch chooses them, or None; why there are none).
    torch takes TORCH_CUDA_ARCH_LIST, else the visible GPUs' (also for TORCH_CUDA_ARCH_LIST=native); with
    neither it fails on an empty list, so the build goes CPU-only instead."""
    requested = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if requested and requested != "native":
        return requested, ""
    try:
        count = torch.cuda.device_count()
    except Exception:  # a driver that cannot be queried: no GPU to read an architecture from
        count = 0
    if count:
        return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(count)})), ""
    setting = "is native" if requested else "is not set"
    return None, (f"no GPU is visible and TORCH_CUDA_ARCH_LIST {setting}; set it (e.g. TORCH_CUDA_ARCH_LIST=9.0) "
                  f"to compile the CUDA kernels for a GPU this machine lacks")


def _cuda_plan(torch, cpp_extension, has_sources: bool, environ=os.environ):
    """(whether to build the CUDA kernels, what the build line says about CUDA)."""
    if environ.get("RLKERNELS_NO_CUDA", "0") == "1":
        return False, "no CUDA (RLKERNELS_NO_CUDA=1)"
    if not torch.version.cuda or not has_sources:
        return False, "no CUDA (a CPU build of torch)" if not torch.version.cuda else "no CUDA sources"
    if _nvcc(cpp_extension) is None:
        return False, "no CUDA: this torch is a CUDA build but no nvcc was found (install the CUDA toolkit)"
    archs, why_not = _cuda_archs(torch, environ)
    if archs is None:
        return False, f"no CUDA: {why_not}"
    return True, f"with CUDA for GPU architectures {archs}"


def _extensions():
    if os.environ.get("RLKERNELS_NO_EXTENSION", "0") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # e.g. an isolated build: a silent pure-Python install would be slower everywhere
        raise SystemExit(f"rlkernels: cannot build the compiled extension: torch is not importable here ({e}). "
                         f"Install torch first, then `pip install --no-build-isolation ...` (an isolated build "
                         f"has no torch); RLKERNELS_NO_EXTENSION=1 installs pure Python") from None

    isa = _cpu_isa(torch)
    isa_flags, isa_macros = ISA_FLAGS[isa]
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    if sys.platform == "win32":  # MSVC: untested; no OpenMP, generic ISA
        cxx = ["/O2", "/fp:precise"]
    else:
        cxx = ["-O3", "-ffp-contract=off", "-Wno-unknown-pragmas", *openmp, *isa_flags, *isa_macros]
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # The kernels (*.cu, torch-free) and their torch bindings (*.cpp, CUDA torch headers).
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    with_cuda, cuda_note = _cuda_plan(torch, cpp_extension, bool(cuda_sources))
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "rlkernels._C", sources + cuda_sources, include_dirs=include_dirs,
            define_macros=[("RLK_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]}, extra_link_args=openmp)
    else:
        ext = cpp_extension.CppExtension(
            "rlkernels._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx}, extra_link_args=openmp)
    return [ext], {"build_ext": _build_command(cpp_extension, f"CPU ISA {isa}, {cuda_note}")}


def _build_command(cpp_extension, what: str):
    """torch's BuildExtension (ninja), with a fixed object folder and one line on what it compiles."""
    class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", f"temp-{tag}")

        def build_extensions(self):
            sources = [s for ext in self.extensions for s in ext.sources]
            jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            seconds = sum(COMPILE_SECONDS.get(os.path.splitext(s)[1], 12) for s in sources) / min(jobs, len(sources))
            took = f"{math.ceil(seconds / 10) * 10} s" if seconds < 90 else f"{math.ceil(seconds / 60)} min"
            print(f"rlkernels: compiling the extension rlkernels._C ({len(sources)} files, {what}) on {jobs} cores: "
                  f"about {took}, less for files unchanged since the last build (RLKERNELS_NO_EXTENSION=1 skips it)",
                  file=sys.stderr, flush=True)
            super().build_extensions()

    return BuildExtension


if __name__ == "__main__":  # pip and `python setup.py` run it as __main__; the tests import its functions
    ext_modules, cmdclass = _extensions()
    setup(
        packages=find_packages(include=["rlkernels", "rlkernels.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
