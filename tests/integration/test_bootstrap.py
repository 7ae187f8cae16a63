"""What `diloco up` ships to hosts installs on any supported Python and platform."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from diloco_cli.launch.bootstrap import build_distribution

PYENV = Path("/root/.pyenv/versions")


def other_python() -> str | None:
    """An interpreter of another minor version than this one, if this machine has one."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in sorted(PYENV.glob("3.1[0-9]*/bin/python3")) if PYENV.exists() else []:
        version = candidate.parent.parent.name
        if not version.startswith(mine + ".") and tuple(int(x) for x in version.split(".")[:2]) >= (3, 10):
            return str(candidate)
    return None


def test_the_wheel_is_platform_independent_and_carries_the_kernel_source(tmp_path):
    wheel = build_distribution(tmp_path / "wheels").wheel
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: true" in metadata and "Tag: py3-none-any" in metadata
    assert "diloco_cli/codec/_kernels.c" in names and not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]


def test_it_installs_on_another_python_and_compiles_the_kernels_there(tmp_path):
    python = other_python()
    if python is None:
        pytest.skip("this machine has no Python of another minor version to install into")
    wheel = build_distribution(tmp_path / "wheels").wheel
    venv = tmp_path / "host-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    host_python = str(venv / "bin" / "python")
    subprocess.run([host_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)
    compiled = subprocess.run([host_python, "-m", "diloco_cli.codec.build"], capture_output=True, text=True, check=True)
    assert "kernels compiled" in compiled.stdout, compiled.stdout + compiled.stderr
    probe = (
        "import ctypes, sys; from diloco_cli.codec.build import kernels_path; "
        "library = ctypes.CDLL(str(kernels_path())); "
        "print(sys.version_info[:2], kernels_path().name, "
        "all(hasattr(library, f'diloco_{op}_{c}') for op in ('quantize', 'dequantize') for c in ('int8', 'int4')))"
    )
    loaded = subprocess.run([host_python, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert (
        loaded.strip().endswith("True") and f"cpython-{Path(python).parent.parent.name.replace('.', '')[:3]}" in loaded
    ), loaded
