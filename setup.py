"""The CPU kernels, built at install time: one extension module per instruction-set level this
machine's compiler can target (neuron/kernels/isa.py), so that no first start compiles anything.
A level the compiler cannot build is skipped with a warning, and with no compiler at all neuron
still installs and runs its float path (the kernels are optional). Everything else is in
pyproject.toml."""

import runpy
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent
isa = runpy.run_path(str(HERE / "neuron" / "kernels" / "isa.py"))
CSRC = "neuron/kernels/csrc"


def extension(level) -> Extension:
    name = isa["module_name"](level.name)
    return Extension(
        f"neuron.kernels.{name}",
        sources=[f"{CSRC}/module.cpp"],
        depends=[str(p.relative_to(HERE)) for p in (HERE / CSRC).glob("*.h")],
        include_dirs=[CSRC],
        define_macros=[(f"NEURON_ISA_{level.name.upper()}", "1"), ("NEURON_MODULE", name)],
        extra_compile_args=[*isa["COMMON_FLAGS"], *level.flags],
        extra_link_args=["-fopenmp"],
        language="c++",
        optional=True,
    )


setup(ext_modules=[extension(level) for level in isa["levels_for"]()])
