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
