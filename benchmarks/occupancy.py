"""Resident threads per SM of a kernel from its registers, shared memory and block size (sm_80, sm_90).

An SM takes one more block of a kernel only if every resource still fits:
* registers: a warp gets its threads' registers in units of 256 (a thread's count rounded up to a
  multiple of 8), from one of four sub-partitions of 16384 registers, each holding whole warps:
  4·⌊16384 / registers per warp⌋ warps per SM;
* shared memory: the block's (static; none of these kernels asks for dynamic) plus the 1 KB the
  driver reserves per block since sm_80, in 128-byte units, against 164 KB (sm_80) or 228 KB (sm_90);
* at most 2048 threads (64 warps) and 32 blocks.
Threads per SM = the fewest blocks any of these allows × the block's threads (the CUDA Programming
Guide's table of compute capabilities gives the limits; the rounding is the occupancy calculator's).
"""
from __future__ import annotations

import dataclasses

WARP = 32


@dataclasses.dataclass(frozen=True)
class SM:
    shared: int  # bytes per SM
    registers: int = 65536
    sub_partitions: int = 4
    register_unit: int = 256  # per warp
    reserved_shared: int = 1024  # per block
    shared_unit: int = 128
    threads: int = 2048
    blocks: int = 32


ARCHS = {"sm_80": SM(shared=164 * 1024), "sm_90": SM(shared=228 * 1024)}


def _round_up(x, unit):
    return -(-x // unit) * unit


def threads_per_sm(arch, registers, shared, block):
    """Threads of `block` threads each, `registers` per thread and `shared` bytes of shared memory per block,
    resident on one SM of `arch` at once."""
    sm = ARCHS[arch]
    warps = -(-block // WARP)
    per_warp = _round_up(max(registers, 1) * WARP, sm.register_unit)
    warps_by_registers = sm.sub_partitions * (sm.registers // sm.sub_partitions // per_warp)
    by_shared = sm.shared // _round_up(shared + sm.reserved_shared, sm.shared_unit)
    blocks = min(warps_by_registers // warps, by_shared, sm.threads // (warps * WARP), sm.blocks)
    return blocks * block
