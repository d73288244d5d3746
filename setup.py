"""Builds the optional fused CPU kernels; without a C compiler the package installs without them.

The kernels are plain C called through ctypes; the module around them uses only Python's stable
ABI (3.10 on), so a wheel is tagged ``cp310-abi3`` and serves every CPython from 3.10 on
(``tools/build_wheel.sh`` builds it and makes it a manylinux wheel).
"""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "scaleopt._kernels",
            sources=["src/scaleopt/csrc/kernels.c"],
            depends=["src/scaleopt/_format.h"] + sorted(str(p) for p in Path("src/scaleopt/csrc").glob("*.h")),
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-std=c99"],
            # libm and libc named outright (the linker drops them as not needed otherwise): a
            # wheel tool reads the C library the module is built for from them
            extra_link_args=["-fopenmp", "-Wl,--no-as-needed", "-lm", "-lc"],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
