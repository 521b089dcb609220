"""What benchmarks/gpu_static.py reads in a compiled kernel's SASS (`cuobjdump -sass`) and ELF (`cuobjdump -elf`).

* Global loads: how many are 128 bits wide, and the widest.
* The streaming loop and its instructions per element. A branch to a lower address closes a loop: the loop
  is every instruction from the branch's target to the branch. The streaming loop is the loop that loads
  the most bits from global memory, the shortest of those (a loop around it loads the same and more; a
  compiler's versioned copies of one loop load the same, and the shortest is the common path). Its
  instructions per element are its instructions (NOPs aside; every instruction between its head and its
  back-edge, so a branch inside it that is rarely taken counts in full) over the elements one thread
  loads in one iteration (the loop's global load bits over the element's bits). That is what one logit
  costs in the issue slots of the SM, whatever the tile: e.g. a Triton tile of 8192 bf16 logits over 512
  threads is two 128-bit loads per thread, 16 logits per iteration.
* The store loop, for a kernel that writes its row from on-chip memory (the two-pass cluster kernel): the same
  rule over global stores (STG) instead of loads.
* The block size of a CUDA kernel: its `__launch_bounds__` (EIATTR_MAX_THREADS), which its launcher launches.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess

_ARCH = re.compile(r"arch = (sm_\w+)")
_FUNCTION = re.compile(r"Function : (\S+)")
# `/*0a30*/  @!P0 LDG.E.128 R4, desc[UR10][R18.64] ;`: address, predicate, opcode (with modifiers), operands.
_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")
_TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")
_INFO = re.compile(r"^\.nv\.info\.(\S+)")
_VALUE = re.compile(r"Value:\s+(.*)")


def load_bits(opcode):
    """Width of an LDG (or STG) from its opcode: LDG.E.128 → 128, LDG.E.U16 → 16, LDG.E.64.CONSTANT → 64,
    LDG.E → 32. (LTC128B is a cache hint, not a width.)"""
    for mod in opcode.split(".")[1:]:
        bits = mod.lstrip("US")
        if bits.isdigit():
            return int(bits)
    return 32


@dataclasses.dataclass
class Function:
    instructions: list  # [(address, opcode, operands)]

    def loads(self, first=0, last=None, kind="LDG"):
        """Bits of each global load (kind="STG": store) between two addresses (inclusive; default: all)."""
        return [load_bits(op) for addr, op, _ in self.instructions
                if op.startswith(kind) and first <= addr <= (last if last is not None else addr)]

    def stores(self, first=0, last=None):
        return self.loads(first, last, "STG")

    def loops(self):
        """[(head, back-edge)] address pairs: one per branch to a lower address (not the trap loop's
        branch to itself at the end of every kernel)."""
        out = []
        for addr, op, operands in self.instructions:
            if op.split(".")[0] == "BRA" and (m := _TARGET.search(operands)):
                target = int(m.group(1), 16)
                if target < addr:
                    out.append((target, addr))
        return out

    def streaming_loop(self, kind="LDG"):
        """(instructions, elements-bits loaded per iteration) of the streaming loop, None without a loop that loads
        (kind="STG": the store loop, the bits it stores)."""
        best = None
        for head, edge in self.loops():
            bits = sum(self.loads(head, edge, kind))
            count = sum(1 for addr, op, _ in self.instructions if head <= addr <= edge and op != "NOP")
            if bits and (best is None or (-bits, count) < (-best[1], best[0])):
                best = (count, bits)
        return best

    def instructions_per_element(self, element_bits, kind="LDG"):
        """Instructions of the streaming loop per element of `element_bits` that a thread loads (kind="STG": of the
        store loop, per element stored); None without one."""
        loop = self.streaming_loop(kind)
        return None if loop is None else loop[0] * element_bits / loop[1]


def functions(path, cuobjdump):
    """{(function, arch): Function} of a cubin or fatbin."""
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    out, arch, current = {}, None, None
    for line in sass.splitlines():
        if m := _ARCH.search(line):
            arch = m.group(1)
        elif m := _FUNCTION.search(line):
            current = out[(m.group(1), arch)] = Function([])
        elif current is not None and (m := _INSTRUCTION.search(line)):
            current.instructions.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def max_threads(path, cuobjdump):
    """{(function, arch): threads of its __launch_bounds__} of a fatbin (functions without one are absent)."""
    elf = subprocess.run([cuobjdump, "-elf", path], capture_output=True, text=True, check=True).stdout
    out, arch, function, attribute = {}, None, None, None
    for line in elf.splitlines():
        if m := _ARCH.search(line):
            arch = m.group(1)
        elif line.startswith("."):  # a section: a function's attributes, or others
            function = m.group(1) if (m := _INFO.match(line)) else None
        elif "Attribute:" in line:
            attribute = line.split()[-1]
        elif attribute == "EIATTR_MAX_THREADS" and function and (m := _VALUE.search(line)):
            x, y, z = (int(v, 16) for v in m.group(1).split())
            out[(function, arch)] = x * y * z
            attribute = None
    return out
