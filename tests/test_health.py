"""The pre-flight health check: the verdict on figures (doctor/health.py) and the pairing of nodes
(worker/measure/health_check.py). A node made slow for real, named before the first step and left out when
the job requeues, is tests/test_slurm.py's; the quiet one-node case (its stage, summary.json's
figures) is checked in test_cli.py's run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp.doctor.health import NodeHealth, best_of, slow_nodes, table
from raytrain_ddp.stops import UnhealthyNode
from raytrain_ddp.worker.measure.health_check import machine_id, pairings, shares_cores


def node(i: int, gemm: float, link: float | None = None, gpu: bool = False, shared: bool = False) -> NodeHealth:
    return NodeHealth(f"n{i}", f"10.0.0.{i}", (i,), gemm, link, gpu, shared)


def test_one_node_is_never_named():
    assert slow_nodes([node(0, 1.0, None)]) == []


def test_two_nodes_compare_with_each_other_not_their_mean():
    # 60 vs 100: 40% below the other node; against the pair's mean (80) it would be only 25% below.
    [slow] = slow_nodes([node(0, 100.0), node(1, 60.0)])
    assert slow.line() == ("health check: node n1 (10.0.0.1) is far below the other nodes' median: "
                           "GEMM 60.0 GFLOPS vs 100.0 GFLOPS")


def test_a_node_is_named_only_when_slow_in_both_passes():
    # n1 held back by another process in the first pass only; n2 throttled in both.
    first = [node(0, 80.0, 0.4), node(1, 9.8, 0.1), node(2, 20.0, 0.4)]
    second = [node(0, 78.0, 0.5), node(1, 79.0, 0.4), node(2, 21.0, 0.3)]
    assert [s.node.host for s in slow_nodes(first)] == ["n1", "n2"]
    both = best_of(first, second)
    assert [(n.gemm_gflops, n.link_gbps) for n in both] == [(80.0, 0.5), (79.0, 0.4), (21.0, 0.4)]
    assert [s.node.host for s in slow_nodes(both)] == ["n2"]
    lone = [node(0, 50.0)]
    assert best_of(lone, [node(0, 40.0)]) == [node(0, 50.0)]  # a lone node has no link figure


def test_two_nodes_links_name_neither():
    # Their one exchange is timed on both sides; a starved peer's side differed 2x here (0.03 vs 0.07).
    assert slow_nodes([node(0, 26.0, 0.03), node(1, 25.0, 0.07)]) == []


def test_spread_seen_between_sound_nodes_names_none():
    # Figures measured on this machine (docs/troubleshooting.md): GEMM 14% apart between two quiet
    # ranks, and four "nodes'" links on one loaded host, the lowest 0.64 of the others' median.
    nodes = [node(0, 97.23, 0.992), node(1, 83.58, 1.625), node(2, 90.0, 1.559), node(3, 95.0, 1.379)]
    assert slow_nodes(nodes) == []


def test_a_slow_link_and_a_slow_gpu_are_named_on_their_own_nodes():
    nodes = [node(0, 700e3, 40.0, gpu=True), node(1, 690e3, 4.0, gpu=True), node(2, 300e3, 39.0, gpu=True),
             node(3, 710e3, 41.0, gpu=True)]
    lines = [s.line() for s in slow_nodes(nodes)]
    assert lines == [
        "health check: node n1 (10.0.0.1) is far below the other nodes' median: link 4.00 GB/s vs 40.00 GB/s",
        "health check: node n2 (10.0.0.2) is far below the other nodes' median: GEMM 300.0 TFLOPS vs 700.0 TFLOPS",
    ]
    error = str(UnhealthyNode([s.line() for s in slow_nodes(nodes)]))
    assert "\n" not in error and error.endswith("stopped before the first step under --health exclude "
                                                "(--health warn trains on it)")


def test_nodes_whose_ranks_share_cores_are_not_judged_by_their_gemm():
    assert slow_nodes([node(0, 100.0, shared=True), node(1, 20.0, shared=True)]) == []
    assert [line.split()[0] for line in table([node(0, 100.0, 2.0), node(1, 20.0, 2.0)])] == ["node", "n0", "n1"]
    assert table([node(0, 100.0, 2.0), node(1, 20.0, 2.0)])[2].endswith("SLOW")


def rank(host: str, cores: list[int], threads: int = 1, machine: str | None = None) -> dict:
    return {"host": host, "machine": machine or host, "cores": cores, "threads": threads}


def test_ranks_share_cores_when_their_threads_outnumber_the_cores_they_may_run_on():
    quick_start = [rank("vm", [0, 1]), rank("vm", [0, 1])]  # 2 ranks x 1 thread on 2 cores: one node
    assert not shares_cores(quick_start, quick_start)
    four = [rank("vm", [0, 1]) for _ in range(4)]  # four Ray nodes side by side on one 2-core host
    assert shares_cores(four[:1], four)
    pinned, free = rank("vm", [1]), rank("vm", [0, 1])  # a Ray node pinned to core 1, another on both
    assert not shares_cores([pinned], [pinned, free]) and not shares_cores([free], [pinned, free])
    assert not shares_cores([rank("a", [0, 1], 2)], [rank("a", [0, 1], 2), rank("b", [0, 1], 2)])  # other hosts
    # containers (or network namespaces) on one machine: their own hostnames, the machine's boot id
    pods = [rank("n1", [0, 1], 2, machine="boot-1"), rank("n3", [0, 1], 2, machine="boot-1")]
    assert shares_cores(pods[:1], pods) and shares_cores(pods[1:], pods)


def test_the_machine_is_the_same_in_another_network_and_hostname_namespace():
    here = machine_id()
    assert here and here != socket.gethostname()  # Linux: the kernel's boot id
    other = subprocess.run(["unshare", "--uts", "--net", "sh", "-c", f"hostname elsewhere && {sys.executable} -c "
                            "'from raytrain_ddp.worker.measure.health_check import machine_id; print(machine_id())'"],
                           capture_output=True, text=True, timeout=60)
    if other.returncode != 0:
        pytest.skip(f"no namespaces here (unshare needs root): {other.stderr.strip()[-200:]}")
    assert other.stdout.strip() == here


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8])
def test_pairings_are_disjoint_rounds_that_never_repeat_a_pair(count):
    rounds = pairings(count)
    assert len(rounds) == min(3, count - 1 + count % 2)
    seen = set()
    for pairs in rounds:
        members = [n for pair in pairs for n in pair]
        assert len(members) == len(set(members)) and set(members) <= set(range(count))
        assert not seen & {frozenset(p) for p in pairs}
        seen |= {frozenset(p) for p in pairs}
    # With three nodes or more, every node meets at least two partners: one slow partner cannot hide it.
    if count >= 3:
        assert all(sum(n in pair for pairs in rounds for pair in pairs) >= 2 for n in range(count))


def cpu_cgroup() -> Path | None:
    """Where this machine's CPU quotas are set: cgroup v1's cpu controller, or v2's root; None without one."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1
    controllers = v2 / "cgroup.controllers"
    return v2 if controllers.exists() and "cpu" in controllers.read_text().split() else None


CPU_CGROUP = cpu_cgroup()


GEMM_IN_A_CGROUP = """
import os, sys
cgroup = sys.argv[1]
if cgroup:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
import torch
from raytrain_ddp.worker.measure.health_check import gemm_gflops
torch.set_num_threads(1)
print(gemm_gflops(torch.device("cpu")))
"""


def gemm_in(cgroup: Path | None) -> float:
    out = subprocess.run([sys.executable, "-c", GEMM_IN_A_CGROUP, str(cgroup or "")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0 or CPU_CGROUP is None, reason="needs root and a cgroup cpu controller")
def test_a_rank_held_to_a_share_of_a_core_shows_that_share():
    """A container's CPU limit (a cgroup quota, as the Slurm testbed's slow node has): 20% of one core
    must read as a slow GEMM, not as the burst that fits in each quota period. ci (2026-11-29): a
    throttled node measured 72.6 GFLOPS against its unthrottled peer's 58.3, and went unnamed."""
    cgroup = CPU_CGROUP / f"rt-health-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        if (cgroup / "cpu.cfs_quota_us").exists():
            (cgroup / "cpu.cfs_period_us").write_text("100000")
            (cgroup / "cpu.cfs_quota_us").write_text("20000")
        else:
            if "cpu" not in (CPU_CGROUP / "cgroup.subtree_control").read_text().split():
                (CPU_CGROUP / "cgroup.subtree_control").write_text("+cpu")
            (cgroup / "cpu.max").write_text("20000 100000")
        free, held = gemm_in(None), gemm_in(cgroup)
    finally:
        cgroup.rmdir()
    assert held < 0.5 * free, (held, free)
