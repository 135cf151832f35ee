"""``python -m sgl_loopkv.launch_cluster`` without starting anything: the cores split between the
workers, worker flags passed through, bad values refused, and a missing router named with its fix."""

from __future__ import annotations

import os

import pytest

from sgl_loopkv.server import cluster as cluster_mod
from sgl_loopkv.server.cluster import INSTALL_HINT, Cluster, cluster_parser, cpu_split


def test_the_cores_are_split_between_the_workers():
    cores = sorted(os.sched_getaffinity(0))
    split = cpu_split(2)
    k = max(len(cores) // 2, 1)
    assert all(len(c) == k for c in split)
    if len(cores) >= 2:
        assert not set(split[0]) & set(split[1])  # each worker on its own cores
    assert cpu_split(3, per_worker=1)[2] == (cores[2 % len(cores)],)  # more workers than cores: shared round the list


def test_worker_flags_pass_through_and_the_cluster_keeps_its_own():
    ns, rest = cluster_parser().parse_known_args(
        [
            "--workers",
            "3",
            "--router-policy",
            "round_robin",
            "--port",
            "31000",
            "--model-path",
            "/m",
            "--loopkv-tier-disk-dir",
            "/kv",
        ]
    )
    assert (ns.workers, ns.router_policy, ns.port) == (3, "round_robin", 31000)
    assert rest == ["--model-path", "/m", "--loopkv-tier-disk-dir", "/kv"]  # every worker gets these unchanged


@pytest.mark.parametrize(("kw", "match"), [({"workers": 0}, "--workers"), ({"policy": "fastest"}, "--router-policy")])
def test_bad_values_are_refused_with_the_flag_named(kw, match):
    with pytest.raises(ValueError, match=match):
        Cluster([], **kw)


def test_a_missing_router_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(cluster_mod, "router_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        cluster_mod.main(["--workers", "2"])
    assert "pip install 'sgl-loopkv[router]'" in str(e.value) and INSTALL_HINT in str(e.value)
    with pytest.raises(RuntimeError, match="sglang-router is not installed"):
        Cluster([]).start()


def test_a_bad_worker_count_on_the_command_line_is_a_clear_error():
    with pytest.raises(SystemExit, match="--workers must be at least 1, not 0"):
        cluster_mod.main(["--workers", "0"])


def test_server_ports_are_picked_where_no_port_0_bind_can_take_them():
    """A worker's port is picked before it starts and bound seconds later; a port of the kernel's
    ephemeral range can be taken meanwhile by any socket bound to port 0 (gloo's listeners in
    another worker's scheduler took one, and that worker never came up). The picks stay below it
    (and below SGLang's own 22000-29999), never repeat, and skip a port in use."""
    import socket

    from sgl_loopkv.server import process

    lo, hi = process.PORT_RANGE
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert hi < min(22000, ephemeral_low)
    ports = [process.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(lo <= p <= hi for p in ports)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        process.PORT_RANGE = (taken, taken)  # the only port there is in use: the fallback, not it
        try:
            assert process.free_port() != taken
        finally:
            process.PORT_RANGE = (lo, hi)
