"""The pre-flight health check's verdict: which node is far below the others, before the first step.

Every rank times a short GEMM, and each node's first rank times exchanges with a few other nodes
(worker/measure/health_check.py). A node's GEMM figure is its slowest rank's; its link figure is its best
exchange, so a slow partner never makes a sound node look slow, while a slow NIC slows every exchange
of its own node. A node is named when a figure is below a share of the other nodes' median: with two
nodes that is the other node, so no mean of a pair hides the gap; and only when a second pass finds
it slow too (best_of). Pure: no torch, no Ray.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

GEMM_FLOOR = 0.7
"""A node whose GEMM rate is under this share of the other nodes' median is slow. Healthy nodes of
one kind agree within a few percent (an H100's bf16 GEMM, a CPU core's fp32); on this 2-core test
machine ranks that share cores spread by up to 25% between runs (docs/troubleshooting.md)."""
LINK_FLOOR = 0.5
"""A node whose best exchange is under this share of the other nodes' median is slow: links spread
more than compute (TCP over a shared switch, gloo's copies), so the bar is lower."""


@dataclass(frozen=True)
class NodeHealth:
    """One node's figures from the check."""

    host: str
    ip: str
    ranks: tuple[int, ...]
    gemm_gflops: float
    """Its slowest rank's GEMM rate (fp32 on CPU, bf16 on GPU)."""
    link_gbps: float | None
    """Its best timed exchange with another node, GB/s both ways together; None on a lone node."""
    gpu: bool
    shared_cores: bool = False
    """Its ranks run more threads than it has cores (CPU): their GEMM says nothing of the node."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> NodeHealth:
        return cls(**{**record, "ranks": tuple(record["ranks"])})

    @property
    def name(self) -> str:
        return f"{self.host} ({self.ip})"


@dataclass(frozen=True)
class SlowNode:
    """A node far below the other nodes' median, in one figure or both."""

    node: NodeHealth
    figures: tuple[tuple[str, float, float], ...]
    """(what, this node's, the other nodes' median): what is "GEMM" or "link"."""

    def line(self) -> str:
        said = "; ".join(f"{what} {show(what, own, self.node.gpu)} vs {show(what, median, self.node.gpu)}"
                         for what, own, median in self.figures)
        return f"health check: node {self.node.name} is far below the other nodes' median: {said}"


def show(what: str, value: float, gpu: bool) -> str:
    if what == "link":
        return f"{value:.2f} GB/s"
    return f"{value / 1000:.1f} TFLOPS" if gpu else f"{value:.1f} GFLOPS"


def slow_nodes(nodes: list[NodeHealth]) -> list[SlowNode]:
    """The nodes far below the others' median in GEMM or link; none with fewer than two nodes."""
    if len(nodes) < 2:
        return []
    found = []
    for i, node in enumerate(nodes):
        others = nodes[:i] + nodes[i + 1:]
        figures = []
        gemms = [o.gemm_gflops for o in others if not o.shared_cores]
        if not node.shared_cores and gemms and node.gemm_gflops < GEMM_FLOOR * statistics.median(gemms):
            figures.append(("GEMM", node.gemm_gflops, statistics.median(gemms)))
        # Two nodes share their one exchange: its time says nothing of which node is slow.
        links = [o.link_gbps for o in others if o.link_gbps is not None]
        if node.link_gbps is not None and len(links) >= 2 and node.link_gbps < LINK_FLOOR * statistics.median(links):
            figures.append(("link", node.link_gbps, statistics.median(links)))
        if figures:
            found.append(SlowNode(node, tuple(figures)))
    return found


def best_of(first: list[NodeHealth], second: list[NodeHealth]) -> list[NodeHealth]:
    """Each node's better GEMM and better link of two passes of the check over the same ranks."""
    again = {n.ip: n for n in second}
    return [
        replace(n, gemm_gflops=max(n.gemm_gflops, again[n.ip].gemm_gflops),
                link_gbps=None if n.link_gbps is None else max(n.link_gbps, again[n.ip].link_gbps))
        for n in first
    ]


def table(nodes: list[NodeHealth]) -> list[str]:
    """The per-node table `raytrain check` prints; the same records go to a run's summary.json."""
    gpu = any(n.gpu for n in nodes)
    unit = "TFLOPS" if gpu else "GFLOPS"
    lines = [f"{'node':<32} {'ranks':>5} {'GEMM ' + unit:>12} {'link GB/s':>10}"]
    slow = {s.node.ip for s in slow_nodes(nodes)}
    for n in nodes:
        gemm = n.gemm_gflops / 1000 if gpu else n.gemm_gflops
        link = "-" if n.link_gbps is None else f"{n.link_gbps:.2f}"
        mark = "  SLOW" if n.ip in slow else ("  (cores shared)" if n.shared_cores else "")
        lines.append(f"{n.name:<32} {len(n.ranks):>5} {gemm:>12.1f} {link:>10}{mark}")
    return lines
