"""The CPU kernels, built at install time: one extension module per instruction-set level this
machine's compiler can target (neuron/kernels/isa.py), so that no first start compiles anything.
A level the compiler cannot build is skipped with a warning, and with no compiler at all neuron
still installs and runs its float path (the kernels are optional). Everything else is in
pyproject.toml."""

import copy
import os
import runpy
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


class BuildExt(build_ext):
    """The levels compile side by side, one a core, each from a source of its own (a file in the
    build directory that includes module.cpp), so that no two write the same object file. A
    module this tree already holds, built in place (the editable install of scripts/setup), is
    copied into a wheel instead of compiled again when it is newer than every file it is built
    from: its sources, headers, this file and isa.py (the flags)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        built = HERE / self.get_ext_filename(ext.name)
        inputs = [HERE / f for f in (*ext.sources, *ext.depends)] + [HERE / "setup.py", HERE / "neuron/kernels/isa.py"]
        if not self.inplace and built.exists() and built.stat().st_mtime > max(f.stat().st_mtime for f in inputs):
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target)
            return
        own = Path(self.build_temp).resolve() / "levels" / f"{ext.name.rsplit('.', 1)[1]}.cpp"
        own.parent.mkdir(parents=True, exist_ok=True)
        text = '#include "module.cpp"\n'
        if not own.exists() or own.read_text() != text:
            own.write_text(text)
        level = copy.copy(ext)
        level.sources, level.depends = [str(own)], [*ext.sources, *ext.depends]
        level.include_dirs = [str(HERE / d) for d in ext.include_dirs]
        super().build_extension(level)


setup(ext_modules=[extension(level) for level in isa["levels_for"]()], cmdclass={"build_ext": BuildExt})
