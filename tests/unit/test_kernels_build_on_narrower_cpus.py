"""The compiled CPU kernels build for CPUs with narrower vector units than this one.

`make test` builds them with `-march=native`, so on an AVX-512 machine the AVX2 and portable
branches (`#ifdef ROLLOUT_CPU_VEC16` / `ROLLOUT_CPU_VEC`) are never compiled. A name used
outside the branch that defines it breaks only other users' builds, and their engine falls back
to the torch attention path with a warning (the lanes path's `transpose_queries` did that to
every CPU without AVX-512). A syntax-and-types pass (`-fsyntax-only`: templates instantiated,
no code generated) with the wider units switched off catches it here: the attention kernel at
AVX2 in `make test` (~9 s), every source at both narrower levels under `slow`.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from kernels.cpu_extension import CFLAGS, SOURCES

NARROWER = {
    "avx2": ["-mno-avx512f"],
    "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma"],
}
FAST = ("paged_attention_cpu.cpp", "avx2")
CASES = [
    pytest.param(source, level, id=f"{source.name}-{level}",
                 marks=[] if (source.name, level) == FAST else [pytest.mark.slow])
    for source in SOURCES for level in NARROWER
]


def compiler() -> str:
    found = shutil.which("c++") or shutil.which("g++")
    if found is None:
        pytest.skip("no C++ compiler: the engine keeps the torch path")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower levels are x86 ISA flags")
    return found


@pytest.mark.parametrize(("source", "level"), CASES)
def test_kernel_source_compiles_without_the_wider_units(source, level):
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    # The flags torch's extension builder passes (its standard, then `cpu_extension.CFLAGS`),
    # then the narrower level: a later -mno-* switches off a unit that -march=native enabled.
    command = [compiler(), "-fsyntax-only", "-std=c++20", *CFLAGS, *NARROWER[level],
               *(f"-isystem{path}" for path in includes), str(source)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, f"{source.name} does not build at {level}:\n" + "\n".join(
        errors[:20] or result.stderr.splitlines()[-20:])


def test_the_fast_sample_is_a_real_case():
    """The case `make test` runs is one of the sources and levels (a rename would otherwise
    leave it matching nothing and the check silently gone)."""
    assert any((path.name, level) == FAST and path.is_file()
               for path in SOURCES for level in NARROWER)
