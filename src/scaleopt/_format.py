"""The kernels' shared vocabulary, defined once: the compact state's constants that its
Python reference (``_compact``), the C kernels (``csrc/``, through ``_format.h``, generated
from this table) and the Triton kernels (``_triton_kernels``) share, and the enumerations the
Python side hands the kernels (weight-decay mode, moment form, gradient and weight kinds, how
a weight is stored). What the constants mean is docs/state.md's "The formats"; each
implementation names them from here, and ``tests/test_format.py`` fails where one writes a
literal of its own, defines an enumeration again, or the header differs from the table.

``python -m scaleopt._format`` prints the header (``src/scaleopt/_format.h``).
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from torch import Tensor

#: tensors with fewer elements keep float32 state
MIN_NUMEL = 4096
#: elements per int8 block (a row's last block may be shorter): a block's largest magnitude
#: is its scale s
BLOCK = 256
#: signed codes q in [-127, 127] decode as q |q| (s / SIGNED_SCALE): 127^2
SIGNED_SCALE = 16129.0
#: the offset of the estimate of a signed code's root: floor(sqrt(y) + ROOT_OFFSET) is the
#: code or one less, and one exact comparison tells which
ROOT_OFFSET = 0.47
#: unsigned codes q in [0, 255] decode as (F(q) - CODE_LOW) (s / UNSIGNED_SCALE), F(q) the
#: float32 of bits (q + CODE_OFFSET) << CODE_SHIFT: F(255) = 1.875
UNSIGNED_SCALE = 1.875
CODE_OFFSET = 768
CODE_SHIFT = 20
#: F(0) = 2^-31, added to y before its top bits are taken
CODE_LOW = 2.0**-31
#: the rounding hash of h (an element's global index plus the key): twice
#: h = ((h >> 16) ^ h) * HASH_MUL, then (h >> 16) ^ h, in 32 bits
HASH_MUL = 0x45D9F3B
#: the key of a step t and a moment: t * STEP_MUL + salt * SALT_MUL, in 32 bits
STEP_MUL = 0x9E3779B9
SALT_MUL = 0x632BE5AB
#: each moment's salt
SALTS = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 3, "momentum_buffer": 4}

MASK32 = 0xFFFFFFFF

# -- enumerations: the Python side's names -> the numbers the kernels take ------------------------

#: how a decoupled-or-not weight decay enters LAMB's step (its ``weight_decay_mode``)
WEIGHT_DECAY_MODES = {"update": 0, "decoupled": 1, "l2": 2}
#: how the moments are stored between steps (``_compact``'s forms: a ``state_dtype``)
MOMENT_FORMS = {"float32": 0, "bfloat16": 1, "int8": 2}
#: a gradient's dtype (the Triton kernels' ``G_KIND``; the C kernels take float32 or bfloat16)
GRAD_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}
#: what a weight's 16-bit tensor holds (the Triton kernels' ``W16_KIND``): nothing, the rounded
#: bfloat16 or float16 weights to write, or a split master's lower halves
W16_KINDS = {"none": 0, "bfloat16": 1, "float16": 2, "split": 3}
#: the bits of a tensor's ``kind`` in the C kernels: a bfloat16 gradient, a split master
KIND_BITS = {"bf16_grad": 1, "split": 2}
#: how the C kernels write a weight: float32; float32 and its 16-bit copy; a split master
STORE_FORMS = {"f32": 0, "f32_copy": 1, "split": 2}

#: the enumerations the C header defines, by their prefix there
C_ENUMS = {"MODE": WEIGHT_DECAY_MODES, "FORM": MOMENT_FORMS, "KIND": KIND_BITS,
           "STORE": STORE_FORMS}


class Stored(NamedTuple):
    """A tensor's moments as stored in bfloat16 or 8 bits, for the C kernels that update them
    in place, block by block (``_native``), with no float32 working tensors: the state and
    its layout, the int8 scales' local pieces, the length of a row of blocks, and where the
    local piece starts in the whole tensor (the rounding's index; None when it is no run of
    it)."""

    form: str
    state: Dict[str, Any]
    template: Tensor
    scales: Tuple[Optional[Tensor], Optional[Tensor]]
    row_len: int
    offset: Optional[int]


def salt_key(moment: str) -> int:
    """A moment's part of the rounding key, salt * SALT_MUL in 32 bits."""
    return SALTS[moment] * SALT_MUL & MASK32


def _c_float(x: float) -> str:
    """``x`` rounded to float32 (as Python's float constants of the Triton kernels and
    torch's float32 arithmetic round it), as a C float literal (hexadecimal: exact)."""
    return f"{struct.unpack('f', struct.pack('f', x))[0].hex()}f"


def header() -> str:
    """The C header of the table (``_format.h``)."""
    lines = [
        "/* The compact state's format: generated from scaleopt/_format.py by",
        " * `python -m scaleopt._format > src/scaleopt/_format.h`; do not edit. */",
        "#ifndef SCALEOPT_FORMAT_H",
        "#define SCALEOPT_FORMAT_H",
        f"#define FORMAT_MIN_NUMEL {MIN_NUMEL}",
        f"#define FORMAT_BLOCK {BLOCK}",
        f"#define FORMAT_SIGNED_SCALE {_c_float(SIGNED_SCALE)} /* {SIGNED_SCALE:g} */",
        f"#define FORMAT_ROOT_OFFSET {_c_float(ROOT_OFFSET)} /* {ROOT_OFFSET:g} */",
        f"#define FORMAT_UNSIGNED_SCALE {_c_float(UNSIGNED_SCALE)} /* {UNSIGNED_SCALE:g} */",
        f"#define FORMAT_CODE_OFFSET {CODE_OFFSET}u",
        f"#define FORMAT_CODE_SHIFT {CODE_SHIFT}",
        f"#define FORMAT_CODE_LOW {_c_float(CODE_LOW)} /* 2^-31 */",
        f"#define FORMAT_CODE_LOW_DOUBLE {float(CODE_LOW).hex()}",
        f"#define FORMAT_HASH_MUL {HASH_MUL:#X}u".replace("0X", "0x"),
        f"#define FORMAT_STEP_MUL {STEP_MUL:#X}u".replace("0X", "0x"),
        f"#define FORMAT_SALT_MUL {SALT_MUL:#X}u".replace("0X", "0x"),
    ]
    lines += [f"#define FORMAT_SALT_{name.upper()} {salt}u" for name, salt in SALTS.items()]
    lines += ["enum { " + ", ".join(f"{prefix}_{name.upper()} = {value}"
                                    for name, value in table.items()) + " };"
              for prefix, table in C_ENUMS.items()]
    return "\n".join(lines + ["#endif", ""])


if __name__ == "__main__":
    sys.stdout.write(header())
