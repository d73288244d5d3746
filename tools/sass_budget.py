"""What a compiled kernel costs, read from its cubin's machine code (SASS), and the budget it is
held to: instructions per element against the bytes it moves, the width of its global loads
and stores, and how many warps its registers leave resident on an SM.

A step's kernels stream: every element's bytes are read or written once per phase. On a GPU
that issues ``LANES_PER_S`` lane instructions a second and moves ``BYTES_PER_S`` bytes, a
kernel stays bound by memory while each element costs fewer than

    budget = bytes per element x LANES_PER_S / BYTES_PER_S

instructions (per thread, per element it handles). An H100 SXM5: 132 SMs x 4 schedulers x 32
lanes x 1.98 GHz = 33.5e12 lane instructions a second against 3.35e12 bytes a second, 10.0
instructions per byte. (An H200 has the same SMs and 4.8e12 bytes a second: 7.0 per byte.)

The count is of the machine code's instructions over the elements each thread handles: those
a thread executes in the usual case (:func:`executed`: the kernel's own body, without the
blocks that call the out-of-line slow paths of correctly rounded divisions and square roots,
which a thread takes only for subnormal or huge operands), and, for the record, the whole
body. The kernels unroll their tiles (``tl.static_range``) and branch only around those slow
paths, so the usual case is straight-line code.

Used by ``tools/triton_compile.py``; the functions here read text and numbers only.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from scaleopt import _format

#: H100 SXM5's lane instructions a second and memory bandwidth (bytes a second)
LANES_PER_S = 132 * 4 * 32 * 1.98e9
BYTES_PER_S = 3.35e12
#: instructions a kernel may spend per byte it moves and stay bound by memory
PER_BYTE = LANES_PER_S / BYTES_PER_S

#: per arch: (32-bit registers per SM, most resident warps per SM, most resident programs per
#: SM, shared memory per SM in bytes), from NVIDIA's CUDA occupancy tables
SM = {80: (65536, 64, 32, 167936), 90: (65536, 64, 32, 233472)}
#: registers are allocated to a warp in units of this many
REGISTER_UNIT = 256

#: an instruction line of nvdisasm: its address, an optional predicate, the opcode
_INSTRUCTION = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
#: where an out-of-line subroutine (a slow path) starts
_SUBROUTINE = re.compile(r"^\$__internal_\d+_\$")


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """The cubin's SASS, as ``nvdisasm -c`` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout


def width(opcode: str) -> int:
    """Bits one lane moves by a global load or store (``LDG.E.128``: 128, ``STG.E.U8``: 8)."""
    parts = opcode.split(".")
    for bits in ("128", "64"):
        if bits in parts:
            return int(bits)
    if {"U16", "S16"} & set(parts):
        return 16
    if {"U8", "S8"} & set(parts):
        return 8
    return 32


def read_sass(sass: str) -> dict:
    """The body's instructions (``body``: up to the first out-of-line subroutine), those a
    thread executes when no division or square root takes its slow path (``executed``: see
    :func:`executed`), all of them (``total``), and the body's global loads and stores by
    width ({bits: count})."""
    body, total, loads, stores = 0, 0, {}, {}
    lines = []
    in_body = True
    for line in sass.splitlines():
        if _SUBROUTINE.match(line.strip()):
            in_body = False
        if in_body:
            lines.append(line)
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        op = m.group(1)
        total += 1
        if not in_body or op == "NOP":
            continue
        if op == "BRA" and _self_branch(line):
            continue  # the trailing loop after EXIT, never reached
        body += 1
        if op.startswith(("LDG.", "STG.")) or op in ("LDG", "STG"):
            into = loads if op.startswith("LDG") else stores
            bits = width(op)
            into[bits] = into.get(bits, 0) + 1
    return dict(body=body, executed=executed(lines), total=total, loads=loads, stores=stores)


_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_PREDICATED = re.compile(r"/\*[0-9a-f]{4,}\*/\s+@!?U?P[T0-9]+\s")


def executed(lines) -> int:
    """The body's instructions in the basic blocks a thread can reach from the entry without
    entering a block that calls a slow path (``CALL``: the correctly rounded divisions' and
    square roots' out-of-line code for subnormal or huge operands, and the moves around the
    call): what a thread executes in the usual case (NOPs and the padding loop left out)."""
    blocks = [([], [])]  # (labels, [(predicated, opcode, branch target)])
    for line in lines:
        label = _LABEL.match(line.strip())
        if label:
            if blocks[-1][1]:
                blocks.append(([], []))
            blocks[-1][0].append(label.group(1))
            continue
        m = _INSTRUCTION.search(line)
        if not m or (m.group(1) == "BRA" and _self_branch(line)):
            continue
        op = m.group(1)
        target = _TARGET.search(line) if op.startswith("BRA") else None
        blocks[-1][1].append((bool(_PREDICATED.search(line)), op,
                              target.group(1) if target else None))
        if op.startswith(("BRA", "EXIT", "CALL", "RET")):
            blocks.append(([], []))
    at = {label: i for i, (labels, _) in enumerate(blocks) for label in labels}
    slow = {i for i, (_, ins) in enumerate(blocks)
            if any(op.startswith("CALL") for _, op, _ in ins)}
    seen, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i in seen or i in slow or i >= len(blocks):
            continue
        seen.add(i)
        ins = blocks[i][1]
        last = ins[-1] if ins else None
        if last is not None and last[2] is not None:
            todo.append(at[last[2]])
        ends = last is not None and not last[0] and last[1].startswith(("BRA", "EXIT", "RET"))
        if not ends:
            todo.append(i + 1)
    return sum(op != "NOP" for i in seen for _, op, _ in blocks[i][1])


def _self_branch(line: str) -> bool:
    """``/*ab30*/ BRA 0xab30`` (or to its own label): the padding loop after the last EXIT."""
    m = re.search(r"/\*([0-9a-f]+)\*/\s+BRA\s+(?:0x)?([0-9a-f]+)\s*;", line)
    return bool(m) and int(m.group(1), 16) == int(m.group(2), 16)


def warps_per_sm(registers: int, warps: int, shared: int, capability: int) -> int:
    """Warps resident on one SM for programs of ``warps`` warps using ``registers`` registers
    per thread and ``shared`` bytes of shared memory each."""
    regs, most_warps, most_programs, smem = SM[capability]
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    programs = min(most_programs, regs // (per_warp * warps), most_warps // warps)
    if shared:
        programs = min(programs, smem // shared)
    return programs * warps


_G, _W16, _FORMS = _format.GRAD_KINDS, _format.W16_KINDS, _format.MOMENT_FORMS
#: bytes of one element of a gradient and of a rounded copy (a split master's lower halves
#: are counted with the weight: two 16-bit halves, 4 bytes), by the kernels' kinds
G_BYTES = {_G["float32"]: 4, _G["bfloat16"]: 2, _G["float16"]: 2}
W16_BYTES = {_W16["none"]: 0, _W16["bfloat16"]: 2, _W16["float16"]: 2, _W16["split"]: 0}
#: one moment's bytes per element by form (int8: a code, and a 4-byte scale per 256)
MOMENT_BYTES = {_FORMS["float32"]: 4.0, _FORMS["bfloat16"]: 2.0, _FORMS["int8"]: 1.0 + 4 / 256}


def moved(kernel: str, c: dict) -> tuple:
    """(bytes read, bytes written) per element: what a kernel must read and write of the
    weights, the gradient and the two moments (``c``: its constexprs), as the kernels'
    specification says: the first phases store float32 moments updated, the second phases
    update and store the compact forms, LAMB's float32 second phase does not read the
    gradient, and Adam's one pass reads and writes everything."""
    g = G_BYTES[c["G_KIND"]]
    if kernel == "sum_squares":
        return g, 0
    w, w16, moments = 4, W16_BYTES[c["W16_KIND"]], 2 * MOMENT_BYTES[c["FORM"]]
    float32 = c["FORM"] == _FORMS["float32"]
    if kernel.endswith("_sums"):
        return w + g + moments, moments if float32 else 0
    if kernel == "adam_apply":  # one pass: the moments read and written in every form
        return w + g + moments, w + w16 + moments
    reads_g = not (kernel == "lamb_apply" and float32)
    return w + (g if reads_g else 0) + moments, w + w16 + (0 if float32 else moments)


def bytes_per_element(kernel: str, c: dict) -> float:
    """The bytes a kernel moves per element (:func:`moved`, read and written)."""
    return sum(moved(kernel, c))


def budget(kernel: str, c: dict) -> float:
    """The instructions per element a kernel may spend and stay bound by H100's memory."""
    return bytes_per_element(kernel, c) * PER_BYTE


#: the kernels not yet within their budget in some variant, by (kernel, state form, ALIGNED:
#: 0, 16-byte vectors, int8 rows of whole blocks; only int8 moments without vectors): the
#: most instructions per element (executed in the usual case) any of their variants may take
#: for sm_90, what the worst of them takes now (int8: every kind of weights and gradients in
#: the cover's five sets of options), so that none grows while they are brought within it
HELD = {
    ("lamb_sums", "int8", 0): 84,
    ("lans_sums", "int8", 0): 94,
    ("lamb_apply", "int8", 0): 147,
    ("lans_apply", "int8", 0): 154,
    ("adam_apply", "int8", 0): 152,
}
_FORM_NAMES = {v: k for k, v in _FORMS.items()}


def limit(kernel: str, c: dict) -> float:
    """The most instructions per element a variant may take: its budget, or where its kernel
    and form are not yet within budget, the count they are held at (:data:`HELD`)."""
    held = HELD.get((kernel, _FORM_NAMES[c["FORM"]], int(c["ALIGNED"])), 0)
    return max(budget(kernel, c), held)
