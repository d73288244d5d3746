"""Compiles the Triton kernels for NVIDIA GPUs without one (``python tests/triton_compile.py
[--all] [capability ...]``, sm_90 by default): each kernel in the kinds the launcher makes,
through Triton's whole pipeline to a cubin. Triton's interpreter, which the other tests run, executes the kernels'
Python and so accepts code that the compiler refuses; this catches that. Prints one line per
variant compiled and exits non-zero at the first that fails."""

from __future__ import annotations

import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be jitted, not interpreted

from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from scaleopt import _triton, _triton_kernels as K  # noqa: E402

#: the kernels' arguments that are pointers (the rest not constexpr are float32 scalars)
POINTERS = {"ptrs": "*i64", "sizes": "*i64", "chunks": "*i64", "scal": "*fp32",
            "skip": "*fp32", "sums": "*fp32", "gsq": "*fp32"}
#: each kernel's options besides the tensors' kinds (first: all off)
OPTIONS = {
    "sum_squares": [{}],
    "lamb_sums": [dict(MODE=0, CLIP=False, HAS_LOWER=False, HAS_UPPER=False),
                  dict(MODE=1, CLIP=True, HAS_LOWER=True, HAS_UPPER=True),
                  dict(MODE=2, CLIP=False, HAS_LOWER=False, HAS_UPPER=True)],
    "lans_sums": [dict(CLIP=False, HAS_LOWER=False, HAS_UPPER=False),
                  dict(CLIP=True, HAS_LOWER=True, HAS_UPPER=True)],
}
OPTIONS["lamb_apply"] = OPTIONS["lamb_sums"]
OPTIONS["lans_apply"] = [dict(o, MOVED=moved) for o, moved in zip(OPTIONS["lans_sums"],
                                                                   (False, True))]
#: (W_SPLIT, G_KIND, LOW_KIND): float32 weights with float32, bfloat16 and float16 gradients
#: and rounded copies, and split masters
KINDS = [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 1, 3)]
FORMS = (0, 1, 2)


def variants(every=False):
    """(kernel name, constexprs) pairs. ``every``: each kernel in every form and tensor kind
    with its options off, and every other set of options once per form. Otherwise each kernel
    once per form, the tensor kinds and the options taken in turn (every branch of the kernels
    and their helpers at least once)."""
    if not every:
        for k, (name, options) in enumerate(OPTIONS.items()):
            for form in FORMS:
                kind = KINDS[(k + form) % len(KINDS)]
                yield name, dict(options[form % len(options)], W_SPLIT=kind[0],
                                 G_KIND=kind[1], LOW_KIND=kind[2], FORM=form)
        return
    for name, options in OPTIONS.items():
        for form, kind in itertools.product(FORMS, KINDS):
            yield name, dict(options[0], W_SPLIT=kind[0], G_KIND=kind[1], LOW_KIND=kind[2],
                             FORM=form)
        for form, extra in itertools.product(FORMS, options[1:]):
            yield name, dict(extra, W_SPLIT=0, G_KIND=0, LOW_KIND=0, FORM=form)


def compile_one(name, constants, capability):
    fn = getattr(K, name)
    constants = dict(constants, BLOCK=_triton.BLOCK, QB=max(1, _triton.BLOCK // 256),
                     ITERS=_triton.ITERS)
    signature = {a: "constexpr" if a in constants else POINTERS.get(a, "fp32")
                 for a in fn.arg_names}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v
                                               for k, v in constants.items()})
    return triton_compile(src, target=GPUTarget("cuda", capability, 32))


def main(args):
    every = "--all" in args
    capabilities = [int(a) for a in args if a != "--all"] or [90]
    count = 0
    for capability in capabilities:
        for name, constants in variants(every):
            compiled = compile_one(name, constants, capability)
            assert compiled.asm.get("cubin"), (name, constants)
            count += 1
            print(f"sm_{capability} {name} {sorted(constants.items())}", flush=True)
    print(f"compiled {count}")


if __name__ == "__main__":
    main(sys.argv[1:])
