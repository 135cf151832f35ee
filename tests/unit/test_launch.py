"""Argument handling of ``python -m sgl_loopkv.launch_server``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_loopkv.server.launch import CPU_DEFAULTS, with_defaults
from tests.helpers import run_fresh


def test_defaults_never_override_user_flags():
    argv = with_defaults(["--attention-backend", "torch_native", "--dtype=bfloat16"], CPU_DEFAULTS)
    assert argv.count("--attention-backend") == 1 and "torch_native" in argv
    assert "--dtype=bfloat16" in argv and "--dtype" not in argv
    assert "--sleep-on-idle" in argv and argv[argv.index("--device") + 1] == "cpu"


def test_a_default_for_a_renamed_flag_never_overrides_its_old_name():
    """The cluster's worker default: a later ``--loopkv-limit-max-client-requests 0`` would win over the
    user's old spelling."""
    given = ["--loopkv-max-client-requests=5"]
    assert with_defaults(given, {"--loopkv-limit-max-client-requests": "0"}) == given


def test_loopkv_flags_are_split_off_and_handed_to_subprocesses(tmp_path):
    out = run_fresh(
        f"""
        import json, os
        from sgl_loopkv.server.launch import build_sglang_argv
        cfg, argv, on_gpu = build_sglang_argv(
            ["--model-path", "/m", "--loopkv-device", "cpu", "--loopkv-cache-dir", "{tmp_path}", "--port", "1"])
        from sgl_loopkv.config import LoopKVConfig
        print(json.dumps({{"argv": argv, "on_gpu": on_gpu, "cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
                           "child_cfg": LoopKVConfig.from_env().cache_dir}}))
        """
    )
    assert not any(a.startswith("--loopkv") for a in out["argv"])
    assert out["argv"][:2] == ["--model-path", "/m"] and "--port" in out["argv"]
    assert out["argv"][out["argv"].index("--attention-backend") + 1] == "loopkv"
    assert out["on_gpu"] is False and out["cpu_engine"] == "1"
    assert out["child_cfg"] == str(tmp_path)


def test_bad_loopkv_flag_value_is_rejected():
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_loopkv.launch_server", "--loopkv-device", "tpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "invalid choice: 'tpu'" in proc.stderr


def test_stock_mode_uses_none_of_the_loopkv_components():
    out = run_fresh(
        """
        import json
        from sgl_loopkv.server.launch import build_sglang_argv
        print(json.dumps(build_sglang_argv(["--model-path", "/m", "--loopkv-stock", "--loopkv-device", "cpu"])[1]))
        """
    )
    assert out[out.index("--attention-backend") + 1] == "torch_native"
    assert "--radix-cache-backend" not in out and "--page-size" not in out


def test_cpu_dtype_is_float32_and_bf16_opt_in(monkeypatch):
    """float32 on every CPU, native bf16 or not (bf16 missed its bars, see platform.default_cpu_dtype);
    stock gets the same dtype; an explicit --dtype wins. The native-bf16 detection still reads the
    CPU flags (benchmarks use it to decide whether to run the full bf16 grid)."""
    from sgl_loopkv import platform
    from sgl_loopkv.server import launch

    assert platform.cpu_has_native_bf16({"avx2", "avx512f", "avx512_bf16"})
    assert platform.cpu_has_native_bf16({"amx_bf16", "amx_tile"})
    assert not platform.cpu_has_native_bf16({"avx2", "avx512f", "fma"})
    for flags in ({"avx512_bf16"}, {"avx2"}):
        monkeypatch.setattr(platform, "cpu_flags", lambda f=flags: f)
        for stock in (False, True):
            argv = with_defaults([], launch.cpu_defaults(stock))
            assert argv[argv.index("--dtype") + 1] == "float32"
        argv = with_defaults(["--dtype", "bfloat16"], launch.cpu_defaults(False))
        assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"


def test_gpu_defaults_keep_sglangs_own_components():
    """Until a GPU run shows the tiered cache working there, a GPU serves with SGLang's own attention
    backend and radix cache (and its page size)."""
    from sgl_loopkv.server.launch import GPU_DEFAULTS

    assert not {"--attention-backend", "--radix-cache-backend", "--page-size"} & set(GPU_DEFAULTS)


def test_launcher_registers_the_llama_family_up_front_and_sglang_still_loads_the_rest_on_demand():
    """SGLang's fast start-up path (``SGLANG_EXTERNAL_MODEL_PACKAGE``): the launcher names our package,
    so a Llama server imports one of SGLang's ~285 model modules instead of all; another architecture
    still resolves. Fails if SGLang drops the variable or stops falling back to its own models."""
    out = run_fresh(
        """
        import json, os, sys
        from sgl_loopkv.server.launch import build_sglang_argv
        build_sglang_argv(["--model-path", "/m", "--loopkv-device", "cpu"])
        from sglang.srt.models.registry import ModelRegistry
        llama, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])
        imported = sorted(m for m in sys.modules if m.startswith("sglang.srt.models.") and m.count(".") == 3)
        qwen, _ = ModelRegistry.resolve_model_cls(["Qwen2ForCausalLM"])
        print(json.dumps({"env": os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE"), "llama": llama.__module__,
                          "imported": imported, "qwen": qwen.__module__}))
        """,
        drop_env=("SGLANG_EXTERNAL_MODEL_PACKAGE",),
    )
    assert out["env"] == "sgl_loopkv.models.sglang_archs"
    assert out["llama"] == "sglang.srt.models.llama" and out["qwen"] == "sglang.srt.models.qwen2"
    assert "sglang.srt.models.qwen2" not in out["imported"] and len(out["imported"]) < 20, out["imported"]


def test_stock_mode_and_a_users_own_model_package_keep_sglangs_registry_as_it_is():
    out = run_fresh(
        """
        import json, os
        from sgl_loopkv.server.launch import build_sglang_argv
        build_sglang_argv(["--model-path", "/m", "--loopkv-stock", "--loopkv-device", "cpu"])
        stock = os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "my_models"
        build_sglang_argv(["--model-path", "/m", "--loopkv-device", "cpu"])
        print(json.dumps([stock, os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"]]))
        """,
        drop_env=("SGLANG_EXTERNAL_MODEL_PACKAGE",),
    )
    assert out == [None, "my_models"]


def test_help_lists_every_loopkv_flag_with_its_default_first_and_prints_no_warnings():
    """``--help``: sgl-loopkv's groups first (each flag with its type and default), the SGLang defaults
    the launcher changes, then SGLang's own flags; nothing on stderr (SGLang's server modules warn
    at import about CUDA-only quantization and Triton: the help path does not import them)."""
    from sgl_loopkv.config import LoopKVConfig

    proc = subprocess.run(
        [sys.executable, "-m", "sgl_loopkv.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-4000:]
    ours, _, sglang = proc.stdout.partition("SGLang's own flags follow")
    flat = " ".join(ours.split())
    for o in LoopKVConfig.options():
        assert o.flag in flat and f"(default: {o.default_text()})" in flat, o.flag
    assert flat.count("(default: ") == len(list(LoopKVConfig.options()))
    assert "--attention-backend loopkv / torch_native / -" in flat and "--page-size 16 / - / -" in flat
    assert "--chunked-prefill-size" in sglang and "loopkv" in sglang  # SGLang's flags, our backend among them


def test_a_section_check_failing_is_a_usage_error_not_a_traceback(capsys):
    from sgl_loopkv.server.launch import build_sglang_argv

    with pytest.raises(SystemExit) as e:
        build_sglang_argv(["--model-path", "/m", "--loopkv-prefill-alpha", "2"])
    assert e.value.code == 2 and "error: --loopkv-prefill-alpha must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        build_sglang_argv(["--model-path", "/m", "--loopkv-tier-disk-bytes", "20 gigs"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --loopkv-tier-disk-bytes: '20 gigs' is not a byte size" in err


@pytest.mark.parametrize(
    "flags, gguf",
    [
        ([], True),
        (["--loopkv-weights", "gguf"], True),
        (["--loopkv-weights", "float32"], False),
        (["--loopkv-stock"], False),
    ],
)
def test_a_plain_start_serves_the_default_models_gguf_blocks_and_float32_on_request(flags, gguf):
    """No --model-path on the CPU: the default model's GGUF file from its blocks over a bfloat16 pool; its
    float32 conversion (what stock SGLang serves) with --loopkv-weights float32 or --loopkv-stock. The
    subprocesses get the weights chosen, never 'auto'."""
    out = run_fresh(
        f"""
        import json
        from sgl_loopkv.server.launch import build_sglang_argv
        from sgl_loopkv.config import LoopKVConfig
        cfg, argv, _ = build_sglang_argv({flags!r} + ["--loopkv-device", "cpu"])
        print(json.dumps({{"argv": argv, "weights": LoopKVConfig.from_env().weights}}))
        """
    )
    argv = out["argv"]
    value = lambda flag: argv[argv.index(flag) + 1] if flag in argv else None  # noqa: E731
    assert value("--served-model-name") == "SmolLM2-135M-Instruct"
    assert value("--model-path").endswith(".gguf") is gguf
    assert value("--kv-cache-dtype") == ("bf16" if gguf else None)
    assert out["weights"] == ("gguf" if gguf else "float32")


def test_a_folders_start_resolves_auto_weights_to_float32():
    out = run_fresh(
        """
        import json
        from sgl_loopkv.server.launch import build_sglang_argv
        from sgl_loopkv.config import LoopKVConfig
        build_sglang_argv(["--model-path", "/m", "--loopkv-device", "cpu"])
        print(json.dumps(LoopKVConfig.from_env().weights))
        """
    )
    assert out == "float32"
