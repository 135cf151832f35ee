"""The ``--loopkv-*`` flags: every registry has its flag and every name-choosing flag lists exactly its
registry's names; flag names are stable; sections round-trip through the CLI and the environment."""

from __future__ import annotations

import argparse
import pkgutil
import re
from pathlib import Path

import pytest

import sgl_loopkv
from sgl_loopkv.config import LoopKVConfig, RestoreConfig, SharingConfig, SparsePrefillConfig, TierConfig

#: Every flag users and scripts may already pass (removing or renaming one breaks them).
FLAGS = """
cache-dir device attention-executor stock host-bytes disk-dir disk-bytes disk-free-share disk-read value-policy store-dtype
restore-planner restore-ratio share-layers share-gamma share-ratio share-pairing share-stride
prefill-policy alpha block-size sparse-min-len sparse-dense-tail sparse-tail-samples sparse-full-density
streaming-fraction streaming-sink streaming-local streaming-calibration sparse-executor
decode-policy decode-budget decode-page-size decode-logical-page decode-sink decode-local decode-reuse decode-tau
decode-n-d decode-dense-steps decode-min-context decode-executor
prefix-budget prefix-period prefix-gate prefix-local prefix-prefetch prefix-min-tokens prefix-stream prefix-selection prefix-layer-group prefix-no-host-cache
max-n default-max-tokens max-client-requests shutdown-grace-s
disk-ttl require-salt
""".split()


def registries() -> set[str]:
    """``module:NAME`` of every ``NAME = Registry(...)`` in the package (read from the source, so a new
    registry without a flag fails below)."""
    root = Path(sgl_loopkv.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "kernels") or path.is_relative_to(root / "server"):
            continue
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for name in re.findall(r"^(\w+)(?:: [^=\n]+)? = Registry\(", path.read_text(), re.M):
            found.add(f"{module}:{name}")
    return found


def parse(*argv: str) -> LoopKVConfig:
    parser = argparse.ArgumentParser()
    LoopKVConfig.add_cli_args(parser)
    return LoopKVConfig.from_cli_args(parser.parse_args(list(argv)))


def test_flag_names_are_stable():
    assert [o.flag for o in LoopKVConfig.options()] == ["--loopkv-" + f for f in FLAGS]


def test_every_registry_has_a_flag_whose_choices_are_its_names():
    by_registry = {o.field.metadata["registry"]: o for o in LoopKVConfig.options() if "registry" in o.field.metadata}
    assert set(by_registry) == registries()
    for ref, option in by_registry.items():
        registry = pkgutil.resolve_name(ref)
        off = [option.field.metadata["off"]] if "off" in option.field.metadata else []
        assert option.choices() == off + registry.names(), option.flag
        assert option.field.default in option.choices(), option.flag
        assert not set(off) & set(registry.names())


def test_parser_lists_the_registry_names():
    from sgl_loopkv.attention.policies import POLICIES
    from sgl_loopkv.restore.plan import PLANNERS

    assert parse("--loopkv-restore-planner", "fixed").restore.planner == "fixed"
    for name in POLICIES.names():
        assert parse("--loopkv-prefill-policy", name).sparse.prefill_policy == name
    with pytest.raises(SystemExit):
        parse("--loopkv-restore-planner", "nope")
    assert "fixed" in PLANNERS.names()


def test_sections_from_flags_and_back_through_the_environment(monkeypatch):
    cfg = parse(
        *("--loopkv-restore-planner", "fixed", "--loopkv-restore-ratio", "0.5", "--loopkv-share-layers", "reuse"),
        *("--loopkv-alpha", "0.9", "--loopkv-host-bytes", "123", "--loopkv-device", "cpu"),
    )
    assert cfg.restore == RestoreConfig(planner="fixed", ratio=0.5)
    assert cfg.sharing == SharingConfig(layers="reuse") and cfg.sharing.enabled
    assert cfg.sparse == SparsePrefillConfig(alpha=0.9) and not cfg.sparse.enabled
    assert cfg.tiers == TierConfig(host_bytes=123, disk_dir=str(cfg.resolved_cache_dir / "kv")) and cfg.device == "cpu"
    monkeypatch.delenv("LOOPKV_CONFIG", raising=False)
    assert LoopKVConfig.from_env() == LoopKVConfig()
    cfg.to_env()
    assert LoopKVConfig.from_env() == cfg
    assert LoopKVConfig.from_flat(restore_ratio=0.5, alpha=0.9).restore.ratio == 0.5


def test_sections_validate_their_fields():
    with pytest.raises(ValueError, match="multiples"):
        SparsePrefillConfig(block_size=64, streaming_local=100)
    with pytest.raises(ValueError, match="share-stride"):
        SharingConfig(stride=0)
    with pytest.raises(ValueError, match="host-bytes"):
        TierConfig(host_bytes=-1)
    with pytest.raises(TypeError, match="unknown"):
        LoopKVConfig.from_flat(restore_planer="krul")


def test_each_planner_reads_its_own_section():
    from sgl_loopkv.restore.plan import PLANNERS, FixedSplit, KrulPlanner

    fixed = PLANNERS.create("fixed", RestoreConfig(ratio=0.7))
    assert isinstance(fixed, FixedSplit) and fixed.ratio == 0.7
    calibrated = {name for name in PLANNERS.names() if PLANNERS.create(name, RestoreConfig()).needs_cost_model}
    assert calibrated == {"krul"} and KrulPlanner.needs_cost_model


def test_disk_tier_is_on_by_default_under_the_cache_dir_and_none_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert parse().tiers.disk_path == tmp_path / "sgl-loopkv" / "kv"
    assert parse("--loopkv-cache-dir", str(tmp_path / "c")).tiers.disk_path == tmp_path / "c" / "kv"
    assert parse("--loopkv-disk-dir", "none").tiers.disk_path is None
    assert parse("--loopkv-disk-dir", str(tmp_path / "d")).tiers.disk_path == tmp_path / "d"
