"""Builds the optional fused CPU kernels; without a C compiler the package installs without them."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "scaleopt._kernels",
            sources=["src/scaleopt/_kernels.c"],
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", "-std=c99"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
