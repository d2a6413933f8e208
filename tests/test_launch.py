"""The preflight's arithmetic: can this many workers be placed on these nodes, and with how many CPUs each?"""

from __future__ import annotations

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.launch import choose_layout, cpu_share, placement_problem


def test_fits():
    nodes = [{"CPU": 4, "GPU": 2}, {"CPU": 4, "GPU": 2}]
    assert placement_problem(4, 1, True, nodes) is None
    assert placement_problem(8, 1, False, nodes) is None
    assert placement_problem(2, 4, False, nodes) is None


def test_too_few_gpus_names_the_layout():
    nodes = [{"CPU": 32, "GPU": 4}, {"CPU": 32, "GPU": 4}]
    assert placement_problem(16, 1, True, nodes) == (
        "asked for 16 GPUs, the cluster has 8: 2 nodes x 4 GPUs; lower --workers or add GPU nodes"
    )


def test_gpu_on_a_cpu_cluster():
    problem = placement_problem(2, 1, True, [{"CPU": 8}])
    assert problem.startswith("--gpu asks for 2 GPUs, but the cluster has none") and "drop --gpu" in problem


def test_cpus_do_not_split_across_nodes():
    # 3 CPUs on each of two nodes hold one 2-CPU worker each, not three.
    problem = placement_problem(3, 2, False, [{"CPU": 3}, {"CPU": 3}])
    assert problem.startswith("asked for 3 workers x 2 CPUs, the cluster fits 2: 2 nodes x 3 CPUs")


def test_uneven_nodes():
    problem = placement_problem(9, 1, False, [{"CPU": 4}, {"CPU": 2}])
    assert "4 + 2 CPUs on 2 nodes" in problem


def test_cpu_workers_share_the_cluster_evenly():
    assert cpu_share(2, [2, 2]) == 2  # one worker per node, the whole node each
    assert cpu_share(4, [2, 2]) == 1  # two per node
    assert cpu_share(3, [2, 2]) == 1
    assert cpu_share(2, [8]) == 4
    assert cpu_share(2, [8, 2]) == 4  # both on the big node beats 2 CPUs each
    assert cpu_share(3, [4, 4, 4]) == 4
    assert cpu_share(16, [4, 4]) == 1  # does not fit at all: the preflight says so, not this


def test_layout_on_cpu_spreads_and_shares_unless_told():
    nodes = [2, 2]
    chosen = choose_layout(TrainConfig(workers=2), nodes)
    assert (chosen.cpus_per_worker, chosen.placement) == (2, "spread")
    # An explicit choice wins; the other half is still filled in.
    assert choose_layout(TrainConfig(workers=2, cpus_per_worker=1), nodes).cpus_per_worker == 1
    assert choose_layout(TrainConfig(workers=2, cpus_per_worker=1), nodes).placement == "pack"
    assert choose_layout(TrainConfig(workers=2, placement="pack"), nodes).cpus_per_worker == 2
    # GPUs are packed one CPU each, as before; Ray Data's decode tasks need the CPUs --loader ray leaves.
    gpu = choose_layout(TrainConfig(workers=2, gpu=True), nodes)
    assert (gpu.cpus_per_worker, gpu.placement) == (1, "pack")
    assert choose_layout(TrainConfig(workers=2, loader="ray"), nodes).cpus_per_worker == 1
