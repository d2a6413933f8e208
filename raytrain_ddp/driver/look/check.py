"""`raytrain check`: is this cluster fit to train? Nodes, a collective correctness test, bandwidth.

It replaces the separate all-reduce/broadcast test jobs users run by hand: the same Ray Train worker
group as a real run (same placement, same backend, same env), so what passes here trains.
"""

from __future__ import annotations

from typing import Any

from raytrain_ddp.doctor.health import NodeHealth, slow_nodes, table
from raytrain_ddp.driver.plan.preflight import lay_out
from raytrain_ddp.driver.plan.ray_train import restarts, trainer_configs
from raytrain_ddp.driver.session.connect import connect, ray_address
from raytrain_ddp.errors import one_line
from raytrain_ddp.ray_compat import fast
from raytrain_ddp.ray_compat.state import token_auth_enabled
from raytrain_ddp.worker.measure.collectives import collectives_check

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
"""All-reduce message sizes in bytes for the bandwidth table: latency-bound to bandwidth-bound."""


def bus_bandwidth_gbps(size: int, seconds: float, world: int) -> float:
    """NCCL-tests' bus bandwidth: a ring all-reduce moves 2(n-1)/n of the buffer per rank."""
    return size * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else 0.0


def nodes_table() -> list[str]:
    import ray

    lines = [f"{'node':<24} {'alive':<6} {'CPUs':>5} {'GPUs':>5}"]
    for node in sorted(ray.nodes(), key=lambda n: n["NodeManagerAddress"]):
        res = node["Resources"]
        lines.append(
            f"{node.get('NodeName') or node['NodeManagerAddress']:<24} {str(node['Alive']):<6} "
            f"{int(res.get('CPU', 0)):>5} {int(res.get('GPU', 0)):>5}"
        )
    return lines


def check_cluster(cfg: Any, iters: int) -> bool:
    """Print the cluster and the collective results; True when every rank passed."""
    import ray
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue


    connect(ray_address(cfg), cfg.verbose)
    print(f"Ray {ray.__version__}, token auth {'on' if token_auth_enabled() else 'OFF'}")
    print("\n".join(nodes_table()))
    cfg, _ = lay_out(cfg)  # a request that cannot fit is one line, not a wait
    configs = trainer_configs(cfg, restarts(cfg))
    results = Queue(actor_options={"num_cpus": 0})
    trainer = fast(TorchTrainer)(
        collectives_check,
        train_loop_config={"results": results, "sizes": SIZES, "iters": iters},
        scaling_config=configs.scaling,
        run_config=configs.run,
        torch_config=configs.backend,
    )
    error = None
    try:
        trainer.fit()
    except Exception as err:  # the per-rank reports below say which rank and node
        error = err
    reports = sorted((results.get_nowait() for _ in range(results.qsize())), key=lambda r: r["rank"])
    ray.shutdown()  # done with Ray: left to the exit, its end printed a line of its C++ log (a "lost object")
    failed = [r for r in reports if not r["ok"]]
    for r in failed:
        print(f"FAIL  rank {r['rank']} on {r['host']} ({r['ip']}): {r['error']}")
    if error is not None and not failed:  # it failed before any rank could run the check
        print(f"FAIL  starting {cfg.workers} ranks and their {cfg.resolved_backend} process group: {one_line(error)}")
    if error is not None or failed or len(reports) != cfg.workers:
        return False
    hosts = sorted({r["host"] for r in reports})
    print(f"PASS  all-reduce and broadcast on {cfg.workers} ranks ({reports[0]['backend']}) over {', '.join(hosts)}")
    print(f"{'size':>10} {'latency us':>12} {'bus GB/s':>10}")
    for size, seconds in reports[0]["timings"]:
        print(f"{size:>10} {seconds * 1e6:>12.1f} {bus_bandwidth_gbps(size, seconds, cfg.workers):>10.3f}")
    nodes = [NodeHealth.from_json(node) for node in reports[0]["health"]]
    print("\n" + "\n".join(table(nodes)))  # the health check's per-node figures, as a run's start judges them
    for slow in slow_nodes(nodes):
        print(slow.line())
    return True
