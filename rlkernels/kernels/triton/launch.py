"""What the Triton launchers share: the launch configuration of the row kernels, the checks and
conversions of their inputs, the device guard and the ``wrap`` hook of torch.compile.

Here rather than in a kernel module, so that each launcher imports public names from one place.
"""

import contextlib

import torch
import triton

# Decided when the kernels are decorated: CPU tensors work only if TRITON_INTERPRET=1 was set
# before this package was first imported.
INTERPRET = bool(triton.knobs.runtime.interpret)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Launch configuration: (BLOCK_V, num_warps) from V and the logit size.
# A row ≤ 4096 fits one tile (no loop). Longer rows stream 16 KB tiles (8192 16-bit or 4096
# fp32 logits) so every thread holds 16 logits: two (16-bit) or four (fp32) 16-byte vector
# loads per thread and tile (half a tile at a time in the forward under a cap). ptxas for sm_90
# gives these 30–43 registers, no spills, so 3–4 programs of 512 threads (16-bit) or 5–8 of 256
# (fp32) stay resident per SM (`python -m benchmarks.gpu_static`). H100/H200 need ~32–64 KB of
# reads in flight per SM to reach their 3.3–4.8 TB/s, which that many 16 KB tiles give; a
# 152k-vocabulary row is 19–38 tiles.
# Starting values for Hopper, to be confirmed by benchmarks/gpu_check.sh.
# Under the interpreter (numpy, one program at a time) the cost is per tile, not per element:
# 512-element tiles keep tests fast while V = 1000 and 4099 still take several tiles and a
# partial last one.
_INTERPRET_BLOCK_V = 512


def launch_config(vocab: int, dtype: torch.dtype, interpret: bool = INTERPRET):
    """(BLOCK_V, num_warps) for rows of ``vocab`` logits of ``dtype``."""
    if interpret:
        return min(max(triton.next_power_of_2(vocab), 16), _INTERPRET_BLOCK_V), 1
    if vocab <= 4096:
        block = max(triton.next_power_of_2(vocab), 128)
        return block, 4 if block <= 2048 else 8
    if dtype.itemsize == 2:
        return 8192, 16
    return 4096, 8


def available():
    """(ok, reason): whether this backend can run here."""
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} on CUDA"
    if INTERPRET:
        return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1) on CPU"
    return False, "no CUDA device (CPU tensors need TRITON_INTERPRET=1 before import)"


def check_logits(logits, targets):
    if logits.dtype not in _DTYPES:
        raise TypeError(
            f"logits: the triton backend takes float16, bfloat16 or float32, got {logits.dtype}"
            " (use backend='torch' or 'cpu' for float64)"
        )
    if logits.dim() not in (2, 3) or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected (N, V) or (B, T, V) with unit stride over V, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: V must be at least 1")
    n = logits.shape[:-1].numel()
    if targets.shape != (n,):
        raise ValueError(f"targets: expected shape ({n},) matching the rows of logits, got {tuple(targets.shape)}")
    if logits.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"logits: the triton backend needs CUDA tensors, got {logits.device}; CPU tensors "
            "work only with TRITON_INTERPRET=1 set before rlkernels.kernels.triton is imported"
        )


def row_layout(x):
    """(N, T, batch stride, row stride) of logits (N, V) or (B, T, V): row n = b·T + t lies at
    b·(batch stride) + t·(row stride) (a 2-D tensor is B = 1, T = N)."""
    if x.dim() == 2:
        return x.shape[0], max(x.shape[0], 1), 0, x.stride(0)
    return x.shape[0] * x.shape[1], max(x.shape[1], 1), x.stride(0), x.stride(1)


MAX_BATCHES = 65535  # the largest grid y


def row_grids(n, seq_len):
    """(grid, first_batch) of each launch over the N rows of `row_layout`: T programs along the grid's x, one
    per row of a sequence, and a sequence per program along its y; one launch unless B > 65535."""
    batches = n // seq_len
    for first in range(0, batches, MAX_BATCHES):
        yield (seq_len, min(MAX_BATCHES, batches - first)), first


def row_vector(x, n, device, name, shape=()):
    """An fp32 contiguous (N, *shape) tensor (for entropy, lse_parts (N, 2) and the incoming
    gradients)."""
    if x.shape != (n, *shape):
        raise ValueError(f"{name}: expected shape {(n, *shape)}, got {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.float32).contiguous()


def on_device(device):
    # Triton launches on the current CUDA device; rows on cuda:1 must not run on cuda:0.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def plain(kernel):
    """The default ``wrap``: the kernel itself, launched directly."""
    return kernel


def cap_args(softcap):
    """(c, 1/c) and HAS_CAP of a cap c (0.0: none) for the kernels."""
    softcap = float(softcap)
    return (softcap, 1.0 / softcap if softcap else 0.0), softcap > 0
