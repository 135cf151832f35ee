"""The CPU stand-in for sgl_kernel: used only with the CPU engine and no real package, satisfies
imports, forces SGLang's plain-torch paths, and never computes anything."""

from __future__ import annotations

from tests.helpers import run_fresh

CPU = {"SGLANG_USE_CPU_ENGINE": "1"}


def test_standin_imports_and_refuses_to_compute(tmp_path):
    trace = tmp_path / "trace"
    out = run_fresh(
        """
        import json
        from sgl_loopkv.platform import activate_cpu_standin
        active = activate_cpu_standin()
        from sgl_kernel import copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu
        try:
            from sgl_kernel import fused_moe_kernel  # not a *_cpu name: must not be faked
            fake_non_cpu = True
        except ImportError:
            fake_non_cpu = False
        try:
            copy_all_layer_kv_cache_cpu(1, 2)
            msg = None
        except NotImplementedError as e:
            msg = str(e)
        import os
        print(json.dumps({"active": active, "fake_non_cpu": fake_non_cpu, "msg": msg,
                          "pythonpath": os.environ.get("PYTHONPATH", "")}))
        """,
        env={**CPU, "LOOPKV_STANDIN_TRACE": str(trace)},
    )
    assert out["active"] is True
    assert out["fake_non_cpu"] is False
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu" in out["msg"]
    assert "cpu_standin" in out["pythonpath"]  # reaches children that are not spawned by multiprocessing
    events = [line.split(maxsplit=1)[1] for line in trace.read_text().splitlines()]
    assert events == [
        "import copy_all_layer_kv_cache_cpu",
        "import assign_req_to_token_pool_cpu",
        "call copy_all_layer_kv_cache_cpu",
    ]


def test_standin_keeps_sglang_off_the_amx_kernels():
    """Even on a CPU that reports AMX, SGLang's kernel gate stays closed with the stand-in."""
    out = run_fresh(
        """
        import json
        from sgl_loopkv.platform import activate_cpu_standin
        activate_cpu_standin()
        import sglang.srt.utils.common as common
        common.is_amx_tile_supported = True  # pretend this CPU has AMX tiles
        import sgl_kernel
        print(json.dumps({"amx": common.cpu_has_amx_support(), "standin": sgl_kernel.IS_SGL_LOOPKV_STANDIN}))
        """,
        env=CPU,
    )
    assert out == {"amx": False, "standin": True}


def test_standin_not_used_without_cpu_engine():
    out = run_fresh(
        """
        import json
        from sgl_loopkv.platform import activate_cpu_standin
        active = activate_cpu_standin()
        try:
            import sgl_kernel
            importable = True
        except ImportError:
            importable = False
        print(json.dumps({"active": active, "importable": importable}))
        """,
        drop_env=("SGLANG_USE_CPU_ENGINE",),
    )
    assert out == {"active": False, "importable": False}


def test_real_sgl_kernel_wins(tmp_path):
    fake = tmp_path / "sgl_kernel"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    out = run_fresh(
        """
        import json, sgl_kernel
        from sgl_loopkv.platform import activate_cpu_standin
        print(json.dumps({"active": activate_cpu_standin(), "real": getattr(sgl_kernel, "REAL", False)}))
        """,
        env={**CPU, "PYTHONPATH": str(tmp_path)},
    )
    assert out == {"active": False, "real": True}
