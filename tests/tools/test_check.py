"""`raytrain check` tells a healthy cluster from a broken one."""

from __future__ import annotations

import pytest
from conftest import raytrain

from raytrain_ddp.driver.look.check import bus_bandwidth_gbps


def test_bus_bandwidth_formula():
    # 1 GB in 1 s on 4 ranks: a ring moves 2 * 3/4 of it per rank.
    assert bus_bandwidth_gbps(10**9, 1.0, 4) == pytest.approx(1.5)
    assert bus_bandwidth_gbps(10**9, 1.0, 1) == 0.0


@pytest.mark.e2e
@pytest.mark.smoke
def test_healthy_cluster_passes(ray_head):
    proc = raytrain("check", "--workers", "2", "--iters", "2", env=ray_head.env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "token auth on" in proc.stdout
    assert "PASS  all-reduce and broadcast on 2 ranks (gloo)" in proc.stdout
    bandwidth, health = proc.stdout.split("bus GB/s")[1].strip().split("\n\n")[:2]
    table = bandwidth.splitlines()
    assert [int(line.split()[0]) for line in table] == [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    assert all(float(line.split()[1]) > 0 for line in table)
    # Then the health check's table: one node, its GEMM figure, no link (no other node to exchange with).
    header, *nodes = health.splitlines()
    assert header.split() == ["node", "ranks", "GEMM", "GFLOPS", "link", "GB/s"], health
    [node] = nodes
    *_, ranks, gemm, link = node.removesuffix("  (cores shared)").split()
    assert ranks == "2" and float(gemm) > 0 and link == "-", health


@pytest.mark.e2e
def test_broken_network_fails_and_says_where(ray_head):
    # The interface override reaches the workers (raytrain passes GLOO_*/NCCL_* on) and is wrong.
    env = {**ray_head.env, "GLOO_SOCKET_IFNAME": "nope0"}
    proc = raytrain("check", "--workers", "2", env=env, timeout=180)
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "nope0" in proc.stdout
