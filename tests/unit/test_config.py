"""The ``--loopkv-*`` flags: every registry has its flag and every name-choosing flag lists exactly its
registry's names; flag names are stable; every flag documents itself (type, default, help); byte
quotas take units; sections round-trip through the CLI and the environment."""

from __future__ import annotations

import argparse
import dataclasses
import pkgutil
import re
from pathlib import Path

import pytest

import sgl_loopkv
from sgl_loopkv.attention.policies.config import SparsePrefillConfig
from sgl_loopkv.cache.tier_config import TierConfig
from sgl_loopkv.config import RENAMED, LoopKVConfig, sections
from sgl_loopkv.flags import Bytes, Option, format_bytes, parse_bytes
from sgl_loopkv.krul.config import SharingConfig
from sgl_loopkv.restore.config import RestoreConfig

#: Every flag users and scripts may already pass, as --help names it (removing or renaming one breaks them).
FLAGS = """
cache-dir device attention-executor weights gguf-activations prefill-dtype prefill-softmax stock
tier-host-bytes tier-disk-dir tier-disk-bytes tier-disk-free-share tier-disk-read tier-value-policy tier-store-dtype
restore-planner restore-ratio share-layers share-gamma share-ratio share-pairing share-stride
prefill-policy prefill-alpha prefill-block-size prefill-min-len prefill-dense-tail prefill-tail-samples
prefill-full-density prefill-streaming-fraction prefill-streaming-sink prefill-streaming-local
prefill-streaming-calibration prefill-executor
decode-policy decode-budget decode-page-size decode-logical-page decode-sink decode-local decode-reuse decode-tau
decode-n-d decode-dense-steps decode-min-context decode-executor
prefix-budget prefix-period prefix-gate prefix-local prefix-prefetch prefix-min-tokens prefix-stream prefix-selection prefix-layer-group prefix-no-host-cache
limit-max-n limit-default-max-tokens limit-max-client-requests limit-shutdown-grace-s
lifecycle-disk-ttl lifecycle-require-salt lifecycle-pin-bytes lifecycle-tenant-host-share lifecycle-tenant-disk-share
lifecycle-disk-key-file
""".split()

#: The names those flags had before each section got one prefix, each with a value other than its default
#: (none: a switch): scripts still pass them, so each must keep setting what its new name sets.
OLD_FLAGS = dict(
    pair.split("=")
    for pair in """
host-bytes=1GiB disk-dir=none disk-bytes=1GiB disk-free-share=0.25 disk-read=inline value-policy=lru store-dtype=int8
alpha=0.9 block-size=32 sparse-min-len=100 sparse-dense-tail=8 sparse-tail-samples=4 sparse-full-density=0.5
streaming-fraction=0.25 streaming-sink=128 streaming-local=512 streaming-calibration=c.json sparse-executor=triton
max-n=2 default-max-tokens=16 max-client-requests=0 shutdown-grace-s=1.5
disk-ttl=12h require-salt= pin-bytes=1MiB tenant-host-share=0.5 tenant-disk-share=0.5 disk-key-file=k.key
""".split()
)


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


@pytest.mark.parametrize("old", OLD_FLAGS)
def test_an_old_flag_name_sets_what_its_new_name_sets(old):
    new = LoopKVConfig.flag(RENAMED[old.replace("-", "_")])
    value = [OLD_FLAGS[old]] if OLD_FLAGS[old] else []
    assert parse("--loopkv-" + old, *value) == parse(new, *value) != parse()
    assert new.removeprefix("--loopkv-") in FLAGS


def test_old_flag_names_are_hidden_and_never_clash():
    from sgl_loopkv.server.launch import loopkv_parser

    assert {o.replace("_", "-") for o in RENAMED} == set(OLD_FLAGS)
    assert not set(RENAMED) & LoopKVConfig.option_names() and set(RENAMED.values()) <= LoopKVConfig.option_names()
    help_text = loopkv_parser(add_help=True).format_help()
    shown = set(re.findall(r"--loopkv-[a-z0-9-]*[a-z0-9]", help_text))
    assert shown == {"--loopkv-" + f for f in FLAGS}, shown ^ {"--loopkv-" + f for f in FLAGS}
    assert LoopKVConfig.from_flat(alpha=0.9, max_n=2) == LoopKVConfig.from_flat(prefill_alpha=0.9, limit_max_n=2)
    with pytest.raises(TypeError, match="old and new name"):
        LoopKVConfig.from_flat(alpha=0.9, prefill_alpha=0.8)


def test_each_section_has_one_flag_prefix():
    prefixes = {name: cls.flag_prefix for name, cls in sections().items()}
    assert all(p.endswith("_") for p in prefixes.values()) and len(set(prefixes.values())) == len(prefixes)
    for o in LoopKVConfig.options():
        assert o.section is None or o.name.startswith(prefixes[o.section]), o.flag
    names = [o.name for o in LoopKVConfig.options()]
    assert len(names) == len(set(names))  # e.g. no prefill section field 'dtype' beside --loopkv-prefill-dtype


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
        assert parse("--loopkv-prefill-policy", name).sparse.policy == name
    with pytest.raises(SystemExit):
        parse("--loopkv-restore-planner", "nope")
    assert "fixed" in PLANNERS.names()


def test_sections_from_flags_and_back_through_the_environment(monkeypatch):
    cfg = parse(
        *("--loopkv-restore-planner", "fixed", "--loopkv-restore-ratio", "0.5", "--loopkv-share-layers", "reuse"),
        *("--loopkv-prefill-alpha", "0.9", "--loopkv-tier-host-bytes", "123", "--loopkv-device", "cpu"),
    )
    assert cfg.restore == RestoreConfig(planner="fixed", ratio=0.5)
    assert cfg.sharing == SharingConfig(layers="reuse") and cfg.sharing.enabled
    assert cfg.sparse == SparsePrefillConfig(alpha=0.9) and not cfg.sparse.enabled
    assert cfg.tiers == TierConfig(host_bytes=123, disk_dir=str(cfg.resolved_cache_dir / "kv")) and cfg.device == "cpu"
    monkeypatch.delenv("LOOPKV_CONFIG", raising=False)
    assert LoopKVConfig.from_env() == LoopKVConfig()
    cfg.to_env()
    assert LoopKVConfig.from_env() == cfg
    assert LoopKVConfig.from_flat(restore_ratio=0.5, prefill_alpha=0.9).restore.ratio == 0.5


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
    assert parse("--loopkv-tier-disk-dir", "none").tiers.disk_path is None
    assert parse("--loopkv-tier-disk-dir", str(tmp_path / "d")).tiers.disk_path == tmp_path / "d"


def test_every_flag_shows_its_type_default_and_help():
    problems = [p for o in LoopKVConfig.options() for p in o.problems()]
    assert not problems, "\n".join(problems)
    for section in (LoopKVConfig, *sections().values()):  # each is a group of --help and of the docs page
        assert "title" in vars(section) and section.__doc__.strip(), section
    parser = argparse.ArgumentParser(add_help=False)
    LoopKVConfig.add_cli_args(parser)
    by_flag = {a.option_strings[0]: a for a in parser._actions}
    for o in LoopKVConfig.options():
        action = by_flag[o.flag]
        assert action.help.endswith(f"(default: {o.default_text()})"), o.flag
        assert action.choices or action.metavar or o.switch, o.flag  # the type, as --help shows it
    help_text = " ".join(parser.format_help().split())
    assert help_text.count("(default: ") == len(list(LoopKVConfig.options()))
    assert "--loopkv-tier-host-bytes BYTES Byte quota" in help_text and "(default: 2GiB)" in help_text


def test_the_self_documentation_check_names_what_a_new_flag_lacks():
    @dataclasses.dataclass
    class New:
        no_help: int = dataclasses.field(default=1, metadata={})
        key_file: str | None = dataclasses.field(default=None, metadata={"help": "The key file."})
        quota_bytes: int = dataclasses.field(default=0, metadata={"help": "A quota."})
        ok_bytes: Bytes = dataclasses.field(default=3 << 20, metadata={"help": "A quota."})

    problems = {f.name: Option("new", f).problems() for f in dataclasses.fields(New)}
    assert "'help'" in problems["no_help"][0]
    assert "'default_text'" in problems["key_file"][0]
    assert "annotate it 'Bytes'" in problems["quota_bytes"][0]
    assert problems["ok_bytes"] == [] and Option("new", dataclasses.fields(New)[3]).default_text() == "3MiB"


def test_benchmark_only_flags_are_listed_apart_and_keep_working(impress_registered):
    parser = argparse.ArgumentParser(add_help=False)
    LoopKVConfig.add_cli_args(parser)
    baselines = next(g for g in parser._action_groups if g.title.endswith("benchmark baselines"))
    assert parser._action_groups[-1] is baselines
    flags = {a.option_strings[0] for a in baselines._group_actions}
    assert {"--loopkv-stock", "--loopkv-prefix-selection", "--loopkv-restore-ratio"} <= flags
    assert flags == {o.flag for o in LoopKVConfig.options() if o.baseline}
    cfg = parse("--loopkv-stock", "--loopkv-prefix-selection", "impress", "--loopkv-restore-ratio", "0.7")
    assert cfg.stock and cfg.prefix.selection == "impress" and cfg.restore.ratio == 0.7


def test_a_selection_registered_outside_the_package_is_accepted_only_once_loaded(monkeypatch, capsys):
    """The IMPRESS-style baseline lives in benchmarks/: without it the flag refuses its name, saying
    where it comes from; ``LOOPKV_EXTENSIONS`` naming its module registers it (as in a benchmark's server)."""
    import sys

    from sgl_loopkv import extensions
    from sgl_loopkv.cache.chunk_selection import CHUNK_SELECTIONS
    from sgl_loopkv.cache.prefix_config import PrefixConfig

    # this test's registrations and imports are undone after it
    monkeypatch.setattr(CHUNK_SELECTIONS, "_factories", {"chunks": CHUNK_SELECTIONS._factories["chunks"]})
    monkeypatch.setattr(extensions, "_loaded", set())
    monkeypatch.delitem(sys.modules, "benchmarks.baselines.impress", raising=False)
    monkeypatch.delenv(extensions.ENV, raising=False)
    with pytest.raises(SystemExit):
        parse("--loopkv-prefix-selection", "impress")
    err = capsys.readouterr().err
    assert "unknown chunk selection 'impress'" in err and "benchmarks/baselines/impress.py" in err, err
    assert "LOOPKV_EXTENSIONS=benchmarks.baselines.impress" in err, err
    with pytest.raises(ValueError, match="benchmarks/baselines/impress.py"):
        PrefixConfig(selection="impress")
    monkeypatch.setenv(extensions.ENV, "benchmarks.baselines.impress")
    assert parse("--loopkv-prefix-selection", "impress").prefix.selection == "impress"
    assert CHUNK_SELECTIONS.names() == ["chunks", "impress"] and PrefixConfig(selection="impress").budget == 1.0
    monkeypatch.setenv(extensions.ENV, "benchmarks.baselines.nope")
    with pytest.raises(ImportError, match="LOOPKV_EXTENSIONS names 'benchmarks.baselines.nope'"):
        extensions.load_extensions()


@pytest.mark.parametrize(
    "text, n",
    [
        ("123", 123),
        ("2_000", 2000),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("2 GiB", 2 << 30),
        ("500MB", 500 * 10**6),
        ("1.5G", 1_500_000_000),
        ("1.5GB", 1_500_000_000),
        ("0.5KiB", 512),
        ("1.1k", 1100),
        ("3Ti", 3 << 40),
        ("7B", 7),
        ("0", 0),
    ],
)
def test_byte_sizes_take_si_and_iec_units(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["lots", "", "2XB", "GiB", "1e9", "-1", "-2GiB", "1..5G", "nan", "inf"])
def test_nonsense_byte_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_byte_flags_take_units_and_refuse_nonsense_with_a_clear_error(capsys):
    cfg = parse("--loopkv-tier-host-bytes", "512MiB", "--loopkv-tier-disk-bytes=1.5GB")
    assert cfg.tiers.host_bytes == 512 << 20 and cfg.tiers.disk_bytes == 1_500_000_000
    assert parse("--loopkv-tier-host-bytes", "123").tiers.host_bytes == 123
    with pytest.raises(SystemExit) as e:
        parse("--loopkv-tier-host-bytes", "lots")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: argument --loopkv-tier-host-bytes: 'lots' is not a byte size" in err
    assert [format_bytes(n) for n in (2 << 30, 20 << 30, 3072, 1536, 1000, 0)] == [
        *("2GiB", "20GiB", "3KiB", "1536", "1000", "0")
    ]
