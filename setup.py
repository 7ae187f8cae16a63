"""Builds the optional C kernels of the codec (loaded with ctypes, no Python C-API).

Everything else about the package lives in pyproject.toml.  The extension is optional:
without a C compiler the install still succeeds and the codec uses its torch path.  With
``DILOCO_PURE_WHEEL=1`` (what ``diloco up`` sets to build what it ships to hosts) the
wheel holds the C source instead of a compiled library, is tagged ``py3-none-any``, and
each host compiles the kernels for its own Python and platform.
"""

import os
import runpy

from setuptools import Extension, setup

FLAGS = runpy.run_path("diloco_cli/codec/build.py")["FLAGS"]

setup(
    ext_modules=[]
    if os.environ.get("DILOCO_PURE_WHEEL") == "1"
    else [
        Extension(
            "diloco_cli.codec._kernels",
            sources=["diloco_cli/codec/_kernels.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
