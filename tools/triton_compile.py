"""Compile scaleopt's Triton kernels for NVIDIA GPUs, with no GPU, and hold what LLVM and ptxas
made of them to the kernels' numerical rules and their instruction budgets. Prints one row per
specialization: kernel, arch, registers, warps resident per SM, spill bytes, shared memory,
SASS instructions per element against the budget, global loads and stores by width.

    python tools/triton_compile.py                      # the suite's cover, sm_80 and sm_90
    python tools/triton_compile.py --all 90 -j 2        # every specialization the optimizers launch
    python tools/triton_compile.py --json out.json --markdown

Triton's interpreter, which the other tests run, executes the kernels' Python: it accepts code
the compiler refuses, and it does not show how the compiler rewrites arithmetic. Each variant
goes through Triton's whole pipeline (``triton.compile`` with a ``GPUTarget``) to PTX and a
cubin; ptxas (inside Triton's wheel) reports registers and spills. The rules, read from the
PTX (every one must be 0):

* ``spills``: bytes of spill stores and loads (ptxas ``-v``);
* ``fma``: fused multiply-adds, which would round a product and a sum once where the kernels
  round each (the launch option ``enable_fp_fusion=False`` makes every multiplication and
  addition an explicitly rounded ``mul.rn`` / ``add.rn``, which ptxas never fuses);
* ``unrounded``: float multiplications, additions and subtractions without that ``.rn``;
* ``atomics``: float atomics (their order, and so their sum, changes from run to run);
* ``approx``: approximate square roots, divisions and reciprocals (``sqrt.approx``,
  ``div.full``, ``div.approx``, ``rcp.approx``), except on a source line marked
  ``# estimate:`` (a value an exact comparison then corrects).

And from the cubin's machine code (``nvdisasm``, also in Triton's wheel; ``tools/sass_budget.py``):

* ``over_budget``: more SASS instructions per element than the kernel's budget (its bytes per
  element times H100's instructions per byte of bandwidth), or, for a kernel and state form
  not yet within it, than the count it is held at (``sass_budget.HELD``).

Run as a command, it drops ``TRITON_INTERPRET`` first (the kernels must be jitted, not
interpreted).
Exits with status 1 if a variant breaks a rule, 2 if one does not compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from scaleopt import _format, _triton
from scaleopt._triton_layout import WHOLE_BLOCKS

import sass_budget

#: the kernels' arguments that are pointers (the rest not constexpr are float32 scalars)
POINTERS = {"ptrs": "*i64", "grads": "*i64", "sizes": "*i64", "chunks": "*i64", "scal": "*fp32",
            "skip": "*fp32", "sums": "*fp32", "gsq": "*fp32", "parts": "*fp32",
            "spans": "*i64", "adam": "*fp32"}


#: ALIGNED's values (``_triton._aligned``): none, 16-byte vectors, and for int8 moments rows of
#: whole blocks (other forms take it as 1)
ALIGNMENTS = (0, 1, WHOLE_BLOCKS)
#: each kernel's options besides the tensors' kinds, and the values the launcher can pass
CHOICES = {
    "sum_squares": dict(ALIGNED=ALIGNMENTS),
    "lamb_sums": dict(MODE=tuple(_format.WEIGHT_DECAY_MODES.values()), CLIP=(False, True), HAS_LOWER=(False, True),
                      HAS_UPPER=(False, True), ALIGNED=ALIGNMENTS),
    "lans_sums": dict(CLIP=(False, True), HAS_LOWER=(False, True), HAS_UPPER=(False, True),
                      ALIGNED=ALIGNMENTS),
}
CHOICES["lamb_apply"] = CHOICES["lamb_sums"]
CHOICES["lans_apply"] = dict(CHOICES["lans_sums"], MOVED=(False, True))
CHOICES["adam_apply"] = dict(NESTEROV=(False, True), ALIGNED=ALIGNMENTS)


def options(name, j=None):
    """Kernel ``name``'s sets of options: every one, or (``j``) the one in which each option
    takes its ``j``-th value, cyclically (-1: the last, all on)."""
    choices = CHOICES[name]
    if j is not None:
        return [{k: v[j % len(v)] if j >= 0 else v[-1] for k, v in choices.items()}]
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


#: (W_SPLIT, G_KIND, W16_KIND) of every tensor the kernels take (``_triton.applies``): a float32
#: weight with a float32, bfloat16 or float16 gradient and nothing, a bfloat16 or a float16
#: rounded copy to write; a split master (bfloat16 upper halves, int16 lower ones)
_G, _W16 = _format.GRAD_KINDS, _format.W16_KINDS
KINDS = ([(0, g, _W16[w16]) for g in _G.values() for w16 in ("none", "bfloat16", "float16")]
         + [(1, g, _W16["split"]) for g in _G.values()])
#: four kinds that take every value of each of the three, in turn (the cover)
COVER_KINDS = [(0, _G["float32"], _W16["none"]), (0, _G["bfloat16"], _W16["bfloat16"]),
               (0, _G["float16"], _W16["float16"]), (1, _G["bfloat16"], _W16["split"])]
FORMS = tuple(_format.MOMENT_FORMS.values())
FORM_NAMES = {code: name for name, code in _format.MOMENT_FORMS.items()}
#: the partial sums per slot that ``totals`` adds up (sum_squares 1, LAMB 2, LANS 4)
TOTALS = (1, 2, 4)
#: the suite's default: every rule on the cover for sm_90, the heaviest variants for sm_80
CAPABILITIES = (80, 90)


def variants(every=False, light=False, kinds=False, forms=FORMS):
    """(kernel name, constexprs) pairs, each once. ``every``: each kernel in every form, kind
    and set of options (``totals`` in each width). ``kinds``: every kind of tensors in each of
    the cover's five sets of options and each value of ``ALIGNED``. Otherwise the cover: per
    kernel and form, four variants in which each kind and option takes each of its values at
    least once, and the heaviest (a split master with float16 gradients and every option on).
    ``light``: only the heaviest of each kernel and form. ``forms``: the state forms' codes."""
    out = []
    for name in CHOICES:
        for form in forms:
            if every:
                chosen = list(itertools.product(KINDS, options(name)))
            elif kinds:
                chosen = [(kind, dict(options(name, j)[0], ALIGNED=aligned)) for kind in KINDS
                          for j in (0, 1, 2, 3, -1) for aligned in ALIGNMENTS]
            else:
                cover = [] if light else [(kind, options(name, j)[0])
                                          for j, kind in enumerate(COVER_KINDS)]
                chosen = cover + [((1, _G["float16"], _W16["split"]), options(name, -1)[0])]
            for kind, opts in chosen:
                if form != _format.MOMENT_FORMS["int8"] and opts["ALIGNED"] == WHOLE_BLOCKS:
                    opts = dict(opts, ALIGNED=1)  # (int8 rows only)
                out.append((name, dict(opts, W_SPLIT=kind[0], G_KIND=kind[1],
                                       W16_KIND=kind[2], FORM=form)))
    out += [("totals", {"S": s}) for s in TOTALS]
    unique = {(n, tuple(sorted(c.items()))): (n, c) for n, c in out}
    return list(unique.values())


def compile_one(name, constants, capability):
    """Kernel ``name`` compiled for ``sm_<capability>`` with the launcher's sizes and compile
    options (``_triton.COMPILE_OPTIONS``): Triton's ``CompiledKernel``."""
    fn = getattr(_triton._kernels(), name)
    options = dict(_triton.COMPILE_OPTIONS)
    if name == "totals":
        constants = dict(constants, R=_triton.TOTALS_LANES)
    else:
        sizes = _triton.LAUNCH.constants(name, FORM_NAMES[constants["FORM"]])
        options.update(num_warps=sizes.pop("num_warps"), num_stages=sizes.pop("num_stages"))
        constants = dict(constants, **sizes)
    signature = {a: "constexpr" if a in constants else POINTERS.get(a, "fp32")
                 for a in fn.arg_names}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v
                                               for k, v in constants.items()})
    return triton_compile(src, target=GPUTarget("cuda", capability, 32), options=options)


#: an instruction of PTX (after an optional predicate): its opcode with modifiers
_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s", re.M)
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', re.M)
_FLOAT = r"\.(?:f16|bf16|f32|f64|f16x2|bf16x2)"
RULES = {
    "fma": re.compile(r"^fma\."),
    "unrounded": re.compile(r"^(?:mul|add|sub)(?:\.ftz|\.sat)*" + _FLOAT + "$"),
    "atomics": re.compile(r"^(?:atom|red)\..*" + _FLOAT + "$"),
    "approx": re.compile(r"^(?:sqrt\.approx|div\.full|div\.approx|rcp\.approx|rsqrt\.approx)"),
}
#: the marker of a source line whose approximation an exact step corrects
ESTIMATE = "# estimate:"


def ptx_rules(ptx):
    """{rule: count} over the PTX (see the module's doc), and {opcode: count} of its float
    square roots and divisions (for the record)."""
    files = dict(_FILE.findall(ptx))
    marked = {}
    counts = dict.fromkeys(RULES, 0)
    ops = {}
    where = None
    for line in ptx.splitlines():
        loc = _LOC.match(line)
        if loc:
            where = (files.get(loc.group(1)), int(loc.group(2)))
            continue
        m = _OPCODE.match(line)
        if not m or line.lstrip().startswith("."):
            continue
        op = m.group(1)
        if re.match(r"^(?:sqrt|div|rcp)\..*f32$", op):
            ops[op] = ops.get(op, 0) + 1
        for rule, pattern in RULES.items():
            if pattern.match(op):
                if rule == "approx" and where is not None and _marked(where, marked):
                    continue
                counts[rule] += 1
    return counts, ops


def _marked(where, cache):
    path, line = where
    if path not in cache:
        try:
            cache[path] = Path(path).read_text().splitlines()
        except (OSError, TypeError):
            cache[path] = []
    lines = cache[path]
    return 0 < line <= len(lines) and ESTIMATE in lines[line - 1]


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(ptx, capability):
    """(registers, spill bytes stored + loaded) that ptxas reports for the PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        fmad = [] if _triton.COMPILE_OPTIONS.get("enable_fp_fusion", True) else ["--fmad=false"]
        done = subprocess.run([get_ptxas(capability).path, "-v", *fmad,
                               f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
                               "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    return (int(_PTXAS_USAGE.search(log).group(1)),
            sum(int(a) + int(b) for a, b in _PTXAS_SPILLS.findall(log)))


def inspect(job):
    """One row of the table for (name, constexprs, capability): or the error it raised."""
    name, constants, capability = job
    row = {"kernel": name, "arch": f"sm_{capability}", "constexprs": constants}
    try:
        compiled = compile_one(name, constants, capability)
        assert compiled.asm.get("cubin"), "no cubin"
        ptx = compiled.asm["ptx"]
        row["registers"], row["spills"] = ptxas_usage(ptx, capability)
        row["shared"] = int(compiled.metadata.shared)
        rules, row["ops"] = ptx_rules(ptx)
        row.update(rules)
        row.update(sass_row(name, constants, compiled, row["registers"], capability))
    except Exception as exc:  # reported in the table, and the exit status
        row["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    return row


def _nvdisasm() -> str:
    from triton.backends.nvidia import compiler
    return str(Path(compiler.__file__).parent / "bin" / "nvdisasm")


def sass_row(name, constants, compiled, registers, capability):
    """The machine code's cost (``sass_budget``): the instructions per element each thread
    handles (executed in the usual case, and the whole body's), its global loads and stores by
    width, the warps resident per SM, and the
    kernel's bytes per element and budget (not for ``totals``, which adds a few sums per
    tensor)."""
    sass = sass_budget.read_sass(sass_budget.disassemble(compiled.asm["cubin"], _nvdisasm()))
    warps = compiled.metadata.num_warps
    out = dict(sass=sass["executed"], sass_body=sass["body"], sass_all=sass["total"],
               loads=sass["loads"],
               stores=sass["stores"], warps=warps,
               warps_per_sm=sass_budget.warps_per_sm(registers, warps,
                                                     int(compiled.metadata.shared), capability))
    if name != "totals":
        sizes = _triton.LAUNCH.constants(name, FORM_NAMES[constants["FORM"]])
        tile = sizes["QB"] * 256 if FORM_NAMES[constants["FORM"]] == "int8" else sizes["BLOCK"]
        per_thread = tile * sizes["ITERS"] / (32 * warps)
        out.update(per_element=sass["executed"] / per_thread,
                   per_element_static=sass["body"] / per_thread,
                   moved=sass_budget.moved(name, constants),
                   # per element, the bytes that 128-bit loads read and 128-bit stores write
                   vectors=(16 * sass["loads"].get(128, 0) / per_thread,
                            16 * sass["stores"].get(128, 0) / per_thread),
                   bytes_per_element=sass_budget.bytes_per_element(name, constants),
                   budget=sass_budget.budget(name, constants),
                   limit=sass_budget.limit(name, constants))
        # (the budgets are H100's: sm_90's code is held to them)
        out["over_budget"] = int(capability == 90 and out["per_element"] > out["limit"])
    return out


def broken(row):
    """The rules a row breaks (``error`` where it did not compile)."""
    if "error" in row:
        return ["error"]
    return [rule for rule in ("spills", *RULES, "over_budget") if row.get(rule)]


def label(row):
    c = row["constexprs"]
    if row["kernel"] == "totals":
        return f"totals S={c['S']}"
    kind = ("split" if c["W_SPLIT"] else "f32") + f" g{c['G_KIND']} w16{c['W16_KIND']}"
    options = " ".join(f"{k}={int(v)}" for k, v in sorted(c.items())
                       if k not in ("W_SPLIT", "G_KIND", "W16_KIND", "FORM"))
    return f"{row['kernel']} form{c['FORM']} {kind} {options}".rstrip()


def _widths(counts):
    """{bits: count} as '96x32b 8x64b'."""
    return " ".join(f"{n}x{bits}b" for bits, n in sorted(counts.items(), key=lambda x: int(x[0])))


def _vectors(rows):
    """The share of the global loads' bytes (the tables' too) that 128-bit loads move, over
    ``rows``."""
    moved = sum(int(bits) * n for r in rows for bits, n in r["loads"].items())
    wide = sum(int(bits) * n for r in rows for bits, n in r["loads"].items() if int(bits) == 128)
    return f"{100 * wide / moved:.0f}%" if moved else "-"


def markdown(rows):
    """The table (one row per kernel, arch and form: the most registers of its variants, and
    the totals of the rest) as markdown."""
    groups = {}
    for row in rows:
        if "error" in row:
            continue
        c = row["constexprs"]
        state = ("" if row["kernel"] == "totals" else
                 ("float32", "bfloat16", "int8")[c["FORM"]]
                 + ("", ", aligned", ", whole blocks")[int(c["ALIGNED"])])
        key = (row["kernel"], row["arch"], f"S={c['S']}" if row["kernel"] == "totals" else state)
        groups.setdefault(key, []).append(row)
    lines = ["| kernel | arch | state | variants | registers (most) | warps per SM (fewest) "
             "| SASS per element (most) | budget (least) | bytes loaded by 128-bit loads "
             "| spill bytes | shared memory (bytes) | fma | unrounded | float atomics | approx |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kernel, arch, state), rs in sorted(groups.items()):
        cost = ("| | " if kernel == "totals" else
                f"| {max(r['per_element'] for r in rs):.0f} | {min(r['budget'] for r in rs):.0f} ")
        lines.append(f"| {kernel} | {arch} | {state} | {len(rs)} | {max(r['registers'] for r in rs)} "
                     f"| {min(r['warps_per_sm'] for r in rs)} {cost}| {_vectors(rs)} "
                     f"| {sum(r['spills'] for r in rs)} | {max(r['shared'] for r in rs)} "
                     f"| {sum(r['fma'] for r in rs)} | {sum(r['unrounded'] for r in rs)} "
                     f"| {sum(r['atomics'] for r in rs)} | {sum(r['approx'] for r in rs)} |")
    return "\n".join(lines)


def jobs(capabilities, every, heaviest=False, kinds=False, forms=FORMS):
    out = []
    for capability in capabilities:
        light = heaviest or (not (every or kinds) and capability != max(capabilities))
        out += [(n, c, capability) for n, c in variants(every, light=light, kinds=kinds,
                                                         forms=forms)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capabilities", nargs="*", type=int,
                    help=f"compute capabilities, e.g. 80 90 (default: {' '.join(map(str, CAPABILITIES))}; "
                         "without --all, all but the newest get the heaviest variants only)")
    ap.add_argument("--all", action="store_true", dest="every",
                    help="every specialization the optimizers can launch (thousands: "
                         "about a second each)")
    ap.add_argument("--kinds", action="store_true",
                    help="every kind of tensors (12) in each of the cover's five sets of "
                         "options and each ALIGNED (hundreds)")
    ap.add_argument("--form", choices=list(_format.MOMENT_FORMS),
                    help="only the kernels' variants for moments stored in this form")
    ap.add_argument("--heaviest", action="store_true",
                    help="only the heaviest variant of each kernel and form on every capability "
                         "(the suite's quick cover)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="compiling processes (default: the CPU count)")
    ap.add_argument("--json", metavar="FILE", help="write every row to FILE")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table summarised per kernel, arch and state form")
    args = ap.parse_args(argv)
    forms = (_format.MOMENT_FORMS[args.form],) if args.form else FORMS
    todo = jobs(args.capabilities or CAPABILITIES, args.every, args.heaviest, args.kinds, forms)
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            rows = pool.map(inspect, todo, chunksize=1)
    else:
        rows = [inspect(j) for j in todo]
    for row in rows:
        if "error" in row:
            print(f"{row['arch']} {label(row)}: {row['error']}", flush=True)
        else:
            bad = broken(row)
            cost = (f", {row['per_element']:.0f} SASS per element (budget {row['budget']:.0f}"
                    f"{'' if row['limit'] == row['budget'] else ', held at %.0f' % row['limit']})"
                    if "per_element" in row else "")
            print(f"{row['arch']} {label(row)}: {row['registers']} registers, "
                  f"{row['warps_per_sm']} warps per SM, {row['spills']} spill bytes, "
                  f"{row['shared']} B shared{cost}, loads {_widths(row['loads'])}, stores "
                  f"{_widths(row['stores'])}{'; BREAKS ' + ', '.join(bad) if bad else ''}")
    if args.markdown:
        print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    errors = sum("error" in r for r in rows)
    bad = sum(bool(broken(r)) for r in rows) - errors
    print(f"compiled {len(rows) - errors} of {len(rows)}; {bad} break a rule")
    return 2 if errors else 1 if bad else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are imported (and jitted)
    sys.exit(main())
