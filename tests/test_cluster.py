"""Cluster plumbing: can this many workers be placed on these nodes, with how many CPUs each; and elastic runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp.bench.local_ray import joined_node, local_head
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.plan.fit import busy_problem, choose_layout, cpu_share, placement_problem, size
from raytrain_ddp.ray_compat.state import job_driver, worker_group_start_timeout_s
from raytrain_ddp.run_files import read_csv
from conftest import TINY, raytrain


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
    assert placement_problem(1, 1, True, [{"CPU": 8}]).startswith("--gpu asks for 1 GPU, but")


def test_sizes_read_as_a_person_writes_them():
    assert [size(m) for m in (2048, 300, 2.54, 0.05, 240 / 2**20)] == ["2.0 GiB", "300 MiB", "2.5 MiB", "51 KiB", "240 bytes"]


def test_cpus_do_not_split_across_nodes():
    # 3 CPUs on each of two nodes hold one 2-CPU worker each, not three.
    problem = placement_problem(3, 2, False, [{"CPU": 3}, {"CPU": 3}])
    assert problem.startswith("asked for 3 workers x 2 CPUs, the cluster fits 2: 2 nodes x 3 CPUs")


def test_uneven_nodes():
    problem = placement_problem(9, 1, False, [{"CPU": 4}, {"CPU": 2}])
    assert "4 + 2 CPUs on 2 nodes" in problem


def node(ip: str, total: dict, free: dict) -> dict:
    return {"id": f"id-{ip}", "ip": ip, "total": total, "free": free}


def group(*bundles: tuple[dict, str], state: str = "CREATED") -> dict:
    """A placement group as ray.util.placement_group_table() lists it: (resources, node) per bundle."""
    return {"state": state, "bundles": {i: res for i, (res, _) in enumerate(bundles)},
            "bundles_to_node_id": {i: f"id-{ip}" for i, (_, ip) in enumerate(bundles)}}


HELD = [group(*[({"CPU": 1.0}, "192.0.2.2")] * 3)]
"""Another job's 3 one-CPU bundles on a 4-CPU node."""


def test_what_another_job_holds_is_named_with_the_fix():
    nodes = [node("192.0.2.2", {"CPU": 4.0}, {"CPU": 1.0})]
    assert placement_problem(2, 1, False, [n["total"] for n in nodes]) is None  # the totals hold them
    assert busy_problem(2, 1, False, nodes, HELD) == (
        "asked for 2 workers x 1 CPU; the cluster has them, but only 1 CPU is free now: 3 CPUs are held by "
        "1 placement group (another job or run) on 192.0.2.2; wait with --wait-for-resources SECONDS, "
        "or lower --workers to 1"
    )
    assert busy_problem(1, 1, False, nodes, HELD) is None
    # After --wait-for-resources ran out; a removed group holds nothing, the rest is tasks' or actors'.
    problem = busy_problem(2, 1, False, nodes, [{**HELD[0], "state": "REMOVED"}], waited=30)
    assert "3 CPUs are held by other jobs' tasks or actors on 192.0.2.2; wait longer than --wait-for-resources 30," in problem


def test_the_job_that_made_a_holding_group_is_named_and_whether_it_has_ended():
    nodes = [node("192.0.2.2", {"CPU": 4.0}, {"CPU": 0.0}), node("192.0.2.3", {"CPU": 4.0}, {"CPU": 0.0})]
    held = [{**group(({"CPU": 4.0}, "192.0.2.2")), "creator": "job 05000000, which has ended"},
            {**group(({"CPU": 2.0}, "192.0.2.3")), "creator": "job 07000000"},
            {**group(({"CPU": 2.0}, "192.0.2.3")), "creator": "job 07000000"}]
    assert busy_problem(1, 1, False, nodes, held) == (
        "asked for 1 worker x 1 CPU; the cluster has them, but no CPU is free now: 8 CPUs are held by 3 placement "
        "groups (job 05000000, which has ended; job 07000000) on 192.0.2.2, 192.0.2.3; Ray never frees a placement "
        "group whose job has ended: remove it (ray.util.remove_placement_group) or restart Ray; or wait with "
        "--wait-for-resources SECONDS"
    )
    # Only a group whose job has ended holds them: no wait frees it.
    assert busy_problem(1, 1, False, nodes[:1], held[:1]).endswith(
        "held by 1 placement group (job 05000000, which has ended) on 192.0.2.2; Ray never frees a placement group "
        "whose job has ended: remove it (ray.util.remove_placement_group) or restart Ray")


def test_free_cpus_count_per_node_and_each_holder_is_named():
    nodes = [node("192.0.2.2", {"CPU": 4.0}, {"CPU": 1.0}), node("192.0.2.3", {"CPU": 4.0}, {"CPU": 1.0})]
    # 2 CPUs are free, but not on one node: no 2-CPU worker fits.
    assert busy_problem(1, 2, False, nodes, HELD) == (
        "asked for 1 worker x 2 CPUs; the cluster has them, but only 2 CPUs are free now, room for 0 workers: "
        "3 CPUs are held by 1 placement group (another job or run) on 192.0.2.2, 3 by other jobs' tasks or actors "
        "on 192.0.2.3; wait with --wait-for-resources SECONDS"
    )


def test_an_elastic_run_needs_only_its_min_free():
    nodes = [node("192.0.2.2", {"CPU": 4.0}, {"CPU": 1.0})]
    assert busy_problem(1, 1, False, nodes, HELD, max_workers=4) is None
    assert busy_problem(2, 1, False, nodes, HELD, max_workers=4).startswith(
        "asked for at least 2 workers x 1 CPU (the elastic run's MIN); the cluster has them, but only 1 CPU")
    assert busy_problem(2, 1, False, nodes, HELD, max_workers=4).endswith("or lower --workers to 1:4")


def test_a_running_jobs_driver_is_named_by_pid_node_and_its_command_shortened_in_the_middle():
    assert job_driver(4242, "10.0.0.5", "/opt/venv/bin/python3 train.py  --lr\n0.1") == (
        ", pid 4242 on 10.0.0.5: python3 train.py --lr 0.1")
    long = "/v/bin/python3 -m raytrain_ddp run " + " ".join(f"--opt{i} {i}" for i in range(30)) + " --name mine"
    said = job_driver(7, "10.0.0.5", long)
    assert said.startswith(", pid 7 on 10.0.0.5: python3 -m raytrain_ddp run --opt0 0") and said.endswith(" --name mine")
    assert " … " in said and len(said) < 160
    assert job_driver(0, "", "") == ""  # a job the GCS keeps no driver for: its id alone


def test_held_gpus_and_cpus():
    gpus = [node("192.0.2.2", {"CPU": 8.0, "GPU": 4.0}, {"CPU": 6.0, "GPU": 2.0})]
    held = [group(({"CPU": 1.0, "GPU": 1.0}, "192.0.2.2"), ({"CPU": 1.0, "GPU": 1.0}, "192.0.2.2"))]
    assert busy_problem(4, 1, True, gpus, held).startswith(
        "asked for 4 GPUs; the cluster has them, but only 2 GPUs are free now: 2 GPUs are held by 1 placement group")
    # GPUs free, CPUs not: the CPUs are named.
    busy = [node("192.0.2.2", {"CPU": 8.0, "GPU": 4.0}, {"CPU": 1.0, "GPU": 4.0})]
    assert busy_problem(2, 1, True, busy, []).startswith(
        "asked for 2 GPUs and 1 CPU each; the cluster has them, but only 1 CPU is free now: 7 CPUs are held by other jobs'")


def test_a_ray_that_tells_only_the_clusters_free_resources():
    whole = [{"id": "", "ip": "", "total": {"CPU": 8.0}, "free": {"CPU": 1.0}}]
    assert busy_problem(2, 1, False, whole, HELD) == (
        "asked for 2 workers x 1 CPU; the cluster has them, but only 1 CPU is free now: 3 CPUs are held by "
        "1 placement group (another job or run) on 1 node, 4 by other jobs' tasks or actors; "
        "wait with --wait-for-resources SECONDS, or lower --workers to 1"
    )


HOLDER = """
import sys, ray
ray.init()
group = ray.util.placement_group([{"CPU": 1}] * 3)
ray.get(group.ready())
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""
"""Another job: a Ray driver that holds 3 CPUs in a placement group while it runs."""


@pytest.mark.e2e
def test_a_request_the_cluster_has_but_another_job_holds_fails_in_seconds_or_waits(ray_head, tmp_path):
    """Another job holds 3 of the head's 4 CPUs: `--workers 2` fits the cluster but not what is free.
    It exits 2 with the one line before any worker starts (before this, Ray Train retried its worker
    group's start every 60 s, silently); with --wait-for-resources it starts once the other job ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=ray_head.env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    driver = None
    try:
        assert holder.stdout.readline() == "held\n", f"the holder exited {holder.poll()}"
        args = ["run", "--workers", "2", "--storage-path", str(tmp_path), *TINY]
        refused = raytrain(*args, "--name", "refused", env=ray_head.env, timeout=60)
        assert refused.returncode == 2, refused.stderr[-3000:]
        [line] = refused.stderr.strip().splitlines()
        assert re.match(  # the holder's job, as `ray list jobs` names it
            r"error: asked for 2 workers x 1 CPU; the cluster has them, but only 1 CPU is free now: 3 CPUs are held "
            rf"by 1 placement group \(job [0-9a-f]{{8}}, pid {holder.pid} on [0-9.]+: python\S* -c \" import sys, ray "
            r"ray.init\(\) .*\) on ", line), line
        assert line.endswith("; wait with --wait-for-resources SECONDS, or lower --workers to 1"), line
        assert "workers ->" not in refused.stdout  # no worker was asked for

        driver = subprocess.Popen([sys.executable, "-m", "raytrain_ddp", *args, "--name", "waited", "--wait-for-resources", "30"],
                                  env=ray_head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output: list[str] = []
        read_until(driver, "waiting up to 30 s (--wait-for-resources): asked for 2 workers x 1 CPU", output)
        assert output and output[-1].startswith("waiting"), "".join(output)[-3000:]
        holder.stdin.close()  # the other job ends: Ray removes its placement group
        output += driver.stdout.readlines()
        assert driver.wait(timeout=120) == 0, "".join(output)[-3000:]
    finally:
        holder.kill()
        if driver is not None:
            driver.kill()
    assert [r["epoch"] for r in read_csv(tmp_path / "waited" / "metrics.csv")] == ["1"]


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


def elastic_run(tmp_path: Path, name: str, epochs: int, *args: str) -> list[str]:
    """`raytrain run --workers 1:2` on 1-CPU workers, with epochs of a few seconds (a checkpoint
    costs 1-2 s here: few of them)."""
    return [sys.executable, "-m", "raytrain_ddp", "run", "--workers", "1:2", "--cpus-per-worker", "1",
            "--epochs", str(epochs), "--train-samples", "4096", "--val-samples", "64", "--batch-size", "16",
            "--data-workers", "0", "--progress", "plain", "--storage-path", str(tmp_path), "--name", name, *args]


def read_until(driver: subprocess.Popen, prefix: str, output: list[str], containing: str = "") -> None:
    for line in driver.stdout:
        output.append(line)
        if line.startswith(prefix) and containing in line:
            return


NOT_THE_HEAD = (
    "import ray; ray.init(); "
    "print(*[n['NodeID'] for n in ray.nodes() if n['Alive'] and 'node:__internal_head__' not in n['Resources']])"
)


@pytest.mark.e2e
def test_an_elastic_run_grows_when_a_node_joins_and_answers_its_drain_with_a_checkpoint(tmp_path):
    """--workers 1:2 on a 1-CPU head starts with 1 worker. A node joins mid-run: the run grows to 2,
    from the latest checkpoint. Then Ray announces that the node will go (a spot reclaim; here
    `ray drain-node`): the ranks checkpoint at once, and at the drain's deadline the run goes on at
    1 worker from there, without waiting for a worker on the leaving node. (One run for both: each
    run costs a Ray head and a Ray Train start in CI.)"""
    output: list[str] = []
    with local_head(num_cpus=1) as head:
        driver = subprocess.Popen(elastic_run(tmp_path, "elastic", 5, "--resize-check-s", "2", "--checkpoint-every-steps", "32"),
                                  env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            read_until(driver, "epoch 1/5  train loss", output)  # an epoch at 1 worker
            with joined_node(head, num_cpus=1):
                read_until(driver, "resized: 1 -> 2 workers", output)
                read_until(driver, "epoch ", output, "train loss")  # an epoch ended at 2 workers: both ranks train
                assert "2 workers, global batch 32 (resized 1x)" in output[-1], "".join(output)[-3000:]
                others = subprocess.run([sys.executable, "-c", NOT_THE_HEAD], env=head.env, capture_output=True,
                                        text=True, timeout=120, check=True).stdout.split()
                assert len(others) == 1, f"alive nodes besides the head: {others}\n{''.join(output)[-3000:]}"
                subprocess.run(
                    [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", head.address, "--node-id",
                     others[0], "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                     # 15 s: a spot reclaim gives 30 s to 2 min; at 5 s a loaded CI machine once
                     # registered the drain's checkpoint after the deadline (160 samples redone).
                     "--deadline-remaining-seconds", "15"],
                    env=head.env, capture_output=True, text=True, timeout=120, check=True,
                )
                drain_sent = time.time()
                output += driver.stdout.readlines()  # the drained node stays: Ray does not stop it
                driver.wait(timeout=300)
        finally:
            driver.kill()
    log = "".join(output)
    assert driver.returncode == 0, log[-3000:]
    rows = read_csv(tmp_path / "elastic" / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4", "5"], log[-3000:]
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == sizes[-1] == "1" and "2" in sizes and int(rows[-1]["resizes"]) == 2, log[-3000:]
    summary = json.loads((tmp_path / "elastic" / "summary.json").read_text())
    grown, drained = summary["resizes"]
    assert (grown["from"], grown["to"]) == (1, 2) and "room" in grown["why"], grown
    assert (drained["from"], drained["to"]) == (2, 1), drained
    assert "resized: 1 -> 2 workers" in log and "resized: 2 -> 1 workers" in log and summary["world_size"] == 1
    # The run went on from the drain's checkpoint, or a later one: none of the work before it was redone.
    saved = re.search(r"draining a node of this run: checkpointed at epoch (\d+) after (\d+) samples", log)
    assert saved, log[-3000:]
    assert (drained["epoch"], drained["position"]) >= (int(saved[1]), int(saved[2])), (drained, log[-3000:])
    # The restart at the drain's deadline asked for no worker on the leaving node: such a placement
    # group is never placed, and the restart sits out Ray Train's worker-group start timeout first.
    assert drained["at"] - drain_sent < worker_group_start_timeout_s(), (drained["at"] - drain_sent, log[-3000:])


def test_gpu_in_a_slurm_job_without_gpus_names_the_sbatch_flag(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    problem = placement_problem(8, 1, True, [{"CPU": 32}, {"CPU": 32}])
    assert problem == (
        "--gpu asks for 8 GPUs, but the cluster has none (2 nodes x 0 GPUs): Slurm job 4242 was given no GPUs; "
        "submit it with sbatch --gpus-per-node=4 (or --gres=gpu:4)"
    )
    assert "--gpus-per-node=2" in placement_problem(3, 1, True, [{"CPU": 8}, {"CPU": 8}])  # 3 ranks on 2 nodes
    monkeypatch.delenv("SLURM_JOB_ID")
    assert "drop --gpu" in placement_problem(8, 1, True, [{"CPU": 32}, {"CPU": 32}])  # off Slurm, the CPU way out
