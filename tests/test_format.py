"""The compact format defined once (``scaleopt._format``): the C header is the table's, and no
implementation writes a constant of the format as a literal of its own, where a change to the
table would leave it behind."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from scaleopt import _format

SRC = Path(_format.__file__).parent
#: the implementations of the format: the Python reference, the C kernels (every part of
#: csrc/), the Triton kernels
IMPLEMENTATIONS = (["_compact.py"] + sorted(str(p.relative_to(SRC)) for p in SRC.glob("csrc/*.[ch]"))
                   + ["_triton_kernels.py"])


def _format_values():
    """The values a literal must not take (a float constant as float32 rounds it too)."""
    values = {_format.SIGNED_SCALE, _format.UNSIGNED_SCALE, _format.ROOT_OFFSET,
              _format.CODE_OFFSET, _format.CODE_LOW, _format.HASH_MUL, _format.STEP_MUL,
              _format.SALT_MUL, _format.MIN_NUMEL}
    return values | {_format.salt_key(moment) for moment in _format.SALTS}  # pre-folded salts


def _python_literals(text):
    """The numbers a Python source writes in its code (not in comments or docstrings), with
    ``2 ** -k`` read as one number."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                tokenize.INDENT, tokenize.DEDENT)]
    out, skip = [], set()
    for i, t in enumerate(tokens):
        if t.type != tokenize.NUMBER or i in skip:
            continue
        value = ast.literal_eval(t.string)
        after = [x.string for x in tokens[i + 1:i + 4]]
        if after[:2] == ["**", "-"] and len(after) == 3:
            value = value ** -ast.literal_eval(after[2])
            skip.add(i + 3)
        out.append((t.start[0], t.string, value))
    return out


_C_NUMBER = re.compile(r"\b(0[xX][0-9a-fA-F.]+[pP][+-]?\d+[fF]?|0[xX][0-9a-fA-F]+[uUlL]*"
                       r"|\d+\.\d*(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?|\d+[uUlL]*)")


def _c_value(literal):
    s = literal.rstrip("fFuUlL") if not literal.lower().startswith("0x") or "p" in \
        literal.lower() else literal.rstrip("uUlL")
    if s.lower().startswith("0x") and "p" in s.lower():
        return float.fromhex(s.rstrip("fF"))
    if s.lower().startswith("0x"):
        return int(s, 16)
    return float(s) if any(c in s for c in ".eE") else int(s)


def _c_literals(text):
    """The numbers a C source writes in its code (comments and strings blanked out, lines
    kept)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))

    code = re.sub(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"", blank, text, flags=re.S)
    out = []
    for n, line in enumerate(code.splitlines(), 1):
        for m in _C_NUMBER.finditer(line):
            out.append((n, m.group(0), _c_value(m.group(0))))
    return out


def test_the_c_header_is_the_table():
    """``_format.h``, which the C kernels include, is what ``python -m scaleopt._format``
    makes of the table: regenerate it after changing the table."""
    assert (SRC / "_format.h").read_text() == _format.header()


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_no_implementation_writes_a_constant_of_the_format(name):
    text = (SRC / name).read_text()
    literals = _c_literals(text) if name.endswith((".c", ".h")) else _python_literals(text)
    banned = _format_values()
    found = [(line, literal) for line, literal, value in literals if value in banned]
    assert not found, f"{name} writes the format's constants as literals (line, literal): {found}"


def test_the_checks_find_literals_in_either_language():
    """The readers find what they look for: a literal in code, not in a comment or a
    docstring; ``2.0 ** -31`` as one number; C's hexadecimal floats and suffixes."""
    py = '"""1.875 in a docstring"""\nx = 16129.0  # 768 in a comment\ny = 2.0 ** -31\n'
    assert [(n, v) for n, _, v in _python_literals(py)] == [(2, 16129.0), (3, 2.0 ** -31)]
    c = "/* 0.47f */ float a = 0x1p-31f; // 768\nuint32_t h = x * 0x45D9F3Bu; char *s = \"1.875\";\n"
    assert [(n, v) for n, _, v in _c_literals(c)] == [(1, 2.0 ** -31), (2, 0x45D9F3B)]
    assert {2.0 ** -31, 0x45D9F3B, 16129.0} <= _format_values()


def test_each_enumeration_is_defined_once():
    """The weight-decay modes, moment forms, kinds and store forms: numbered in ``_format``
    alone. The C sources take them from the generated header (no ``enum`` of their own, no
    ``kind & <number>``), the Triton kernels compare with named constants of ``_format``'s
    values (no ``FORM == 2``), and no other Python module writes the table again."""
    prefixes = "|".join(_format.C_ENUMS)
    for path in sorted(SRC.glob("csrc/*.[ch]")):
        text = path.read_text()
        assert not re.search(rf"enum\s*\{{\s*({prefixes})_", text), path.name
        assert not re.search(r"kind\s*&\s*\d", text), path.name
    kernels = (SRC / "_triton_kernels.py").read_text()
    assert not re.findall(r"\b(?:G_KIND|W16_KIND|FORM|MODE)\s*[=!]=\s*\d", kernels)
    tables = [_format.WEIGHT_DECAY_MODES, _format.MOMENT_FORMS, _format.GRAD_KINDS,
              _format.W16_KINDS, _format.KIND_BITS, _format.STORE_FORMS]
    entries = [f'"{name}": {value}' for table in tables for name, value in table.items()
               if value]  # (a code 0 alone says nothing)
    for path in sorted(SRC.rglob("*.py")):
        if path.name != "_format.py":
            text = path.read_text()
            assert not [e for e in entries if e in text], path.name
    header = _format.header()
    for prefix, table in _format.C_ENUMS.items():
        for name, value in table.items():
            assert f"{prefix}_{name.upper()} = {value}" in header
