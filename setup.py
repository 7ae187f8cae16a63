"""Builds the optional C kernels of the codec (loaded with ctypes, no Python C-API).

Everything else about the package lives in pyproject.toml.  The extension is optional:
without a C compiler the install still succeeds and the codec uses its torch path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "diloco_cli.codec._kernels",
            sources=["diloco_cli/codec/_kernels.c"],
            # No contraction of a*b+c into fma: decoding must round q*scale to fp32
            # exactly like the torch path, on every architecture.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
