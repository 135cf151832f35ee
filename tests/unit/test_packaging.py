"""What a wheel of sgl-loopkv holds: every package of its source trees (a missing one installs
fine and fails at import; three were missing until 2026-11-27)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_source_trees_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    # the sgl_kernel stand-in is package data (its own top-level name, put on sys.path by the launcher)
    standin = {p for p in found if p.startswith("sgl_loopkv.kernels.cpu_standin")}
    assert standin and "cpu_standin/sgl_kernel/*.py" in setuptools["package-data"]["sgl_loopkv.kernels"]
    assert sorted(found - standin) == sorted(setuptools["packages"])


def test_the_kernel_prebuild_builds_every_cpp_kernel():
    """``install.sh`` (and benchmarks' ``prebuild_kernels``) run ``python -m sgl_loopkv.kernels.paged_decode``,
    which builds ``all_extensions()``: one per ``kernels/*.cpp``, each its module's ``EXTENSION``. A
    kernel left out would be compiled inside the first server start that needs it (~1 min on 2 cores)."""
    from sgl_loopkv.kernels import native

    cpp = sorted(p.stem for p in (ROOT / "kernels").glob("*.cpp"))
    extensions = native.all_extensions()
    assert cpp and [e.stem for e in extensions] == cpp
    assert all(e.source == ROOT / "kernels" / f"{e.stem}.cpp" for e in extensions)
    assert (
        "all_extensions()" in (ROOT / "kernels" / "paged_decode.py").read_text().split('if __name__ == "__main__":')[1]
    )
