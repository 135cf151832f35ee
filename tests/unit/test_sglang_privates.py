"""The SGLang privates sgl-loopkv relies on (sgl_loopkv/sglang_privates.py) are exactly as pinned,
and the check really notices a changed source (shown on a copy of a pinned method)."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap

from sgl_loopkv.platform import activate_cpu_standin, use_cpu_engine

use_cpu_engine()
activate_cpu_standin()

from sgl_loopkv.sglang_privates import PRIVATES, PrivateUse, check, resolve, source_hash  # noqa: E402


def test_every_pinned_sglang_source_is_unchanged():
    assert check() == []


def test_the_pins_cover_every_private_sglang_method_the_radix_cache_overrides():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sgl_loopkv.cache.radix import LoopKVRadixCache

    pinned = {p.target.rsplit(".", 1)[1] for p in PRIVATES if ":RadixCache." in p.target}
    overridden = {
        n
        for n, v in vars(LoopKVRadixCache).items()
        if callable(v) and hasattr(RadixCache, n) and n.startswith("_") and not n.startswith("__")
    }
    assert overridden and overridden <= pinned, overridden - pinned


def copy_module(tmp_path, name: str, method_source: str) -> str:
    """A module with a class RadixCache holding one method (indented as in SGLang)."""
    (tmp_path / f"{name}.py").write_text("from __future__ import annotations\n\n\nclass RadixCache:\n" + method_source)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return name


def test_the_check_fails_when_a_pinned_method_changes(tmp_path):
    target = next(p for p in PRIVATES if p.target.endswith(":RadixCache._split_node"))
    original = inspect.getsource(resolve(target.target))
    try:
        same = copy_module(tmp_path, "radix_same_copy", original)
        changed_src = original.replace("new_node.lock_ref = child.lock_ref", "new_node.lock_ref = 0")
        assert changed_src != original
        changed = copy_module(tmp_path, "radix_changed_copy", changed_src)
        as_pinned = PrivateUse(f"{same}:RadixCache._split_node", target.sha256, target.use)
        edited = PrivateUse(f"{changed}:RadixCache._split_node", target.sha256, target.use)
        assert check((as_pinned,)) == []  # a verbatim copy hashes as pinned
        (msg,) = check((edited,))  # one changed line: the check names the method and what we use it for
        assert "source changed" in msg and "_split_node" in msg and target.use in msg
        assert source_hash(resolve(edited.target)) != target.sha256
        gone = PrivateUse(f"{same}:RadixCache._no_such_method", target.sha256, target.use)
        assert "gone" in check((gone,))[0]
    finally:
        sys.path.remove(str(tmp_path))
        for m in ("radix_same_copy", "radix_changed_copy"):
            sys.modules.pop(m, None)


def test_a_dedented_or_reformatted_copy_is_a_change_too(tmp_path):
    """The pin is the exact source text: even formatting changes ask for a re-read."""
    target = next(p for p in PRIVATES if p.target.endswith(":RadixCache._delete_leaf"))
    src = inspect.getsource(resolve(target.target)).replace("\n\n", "\n")
    mod = copy_module(tmp_path, "radix_reformatted_copy", textwrap.indent(textwrap.dedent(src), "    "))
    try:
        assert check((PrivateUse(f"{mod}:RadixCache._delete_leaf", target.sha256, target.use),))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)
