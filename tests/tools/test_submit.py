"""`raytrain submit|status|logs|stop` against a real token-secured Ray head with its dashboard, and
the cluster/ manifests.

The e2e tests share one module head started with `ray start --head --block` and every port its own
(several Ray heads run side by side on CI machines), stopped by killing its process group.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import typer.main
import yaml
from conftest import REPO, TINY, free_port, local_head, raytrain
from test_cli import assert_refused

from raytrain_ddp.cli import app
from raytrain_ddp.config import ConfigError, TrainConfig, resolve
from raytrain_ddp.driver.plan.shipping import SHIP_EXCLUDES
from raytrain_ddp.errors import EXIT_INTERRUPTED
from raytrain_ddp.jobs import command as jobs

HEAD_CPUS = 2  # the tiny runs below take 2 workers x 1 CPU
SCRIPT = REPO / "tests" / "scripts" / "torchrun_train.py"


# ---- the config crosses to the cluster as flags -----------------------------------------------


def parse_run_flags(args: list[str]) -> TrainConfig:
    """What `raytrain run ARGS` would train, parsed by the real command, without running it."""
    run = typer.main.get_command(app).commands["run"]
    params = run.make_context("run", list(args)).params
    return resolve(params["config"], {f.name: params[f.name] for f in fields(TrainConfig)})


def test_entrypoint_flags_rebuild_the_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 7\noptimizer: adamw\nlr: 0.003\ngpu: true\namp: false\n")
    cfg = resolve(config, {"workers": 8, "storage_path": "/mnt/shared/runs", "data_dir": "~/data",
                           "placement": "spread", "resume": False, "verbose": True, "name": "exp 1"})
    cfg = jobs.for_cluster(cfg)
    command = shlex.split(jobs.entrypoint(cfg))
    assert command[:4] == ["python", "-m", "raytrain_ddp", "run"]
    assert "--config" not in command  # the file is read here; its values travel as flags
    assert parse_run_flags(command[4:]) == cfg
    assert {"--gpu", "--no-amp", "--no-resume", "--verbose"} <= set(command)


def test_defaults_stay_out_of_the_entrypoint():
    cfg = jobs.for_cluster(TrainConfig(storage_path="/runs", name="a"))
    assert jobs.run_flags(cfg) == ["--storage-path", "/runs", "--name", "a"]


def test_for_cluster_names_the_run_and_drops_the_gcs_address():
    cfg = jobs.for_cluster(TrainConfig(storage_path="/runs", address="10.0.0.1:6379"))
    assert cfg.address is None  # the job's driver gets $RAY_ADDRESS from Ray
    assert re.fullmatch(r"run-\d{8}-\d{6}", cfg.name)


def test_the_run_directory_on_the_cluster_keeps_an_object_stores_endpoint():
    cfg = jobs.for_cluster(TrainConfig(storage_path="s3://b/runs?endpoint_override=http://h:9000", name="a"))
    assert jobs.run_dir(cfg) == "s3://b/runs/a?endpoint_override=http://h:9000"
    assert jobs.run_dir(jobs.for_cluster(TrainConfig(storage_path="/runs/", name="a"))) == "/runs/a"


@pytest.mark.parametrize("flag", ["storage_path", "data_dir"])
def test_relative_paths_are_refused(flag):
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} .* is relative"):
        jobs.for_cluster(TrainConfig(**{"storage_path": "/runs", flag: "runs"}))


def test_runtime_env_ships_only_the_package(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = jobs.runtime_env()
    [package] = env["py_modules"]
    assert Path(package) == REPO / "raytrain_ddp"
    assert "working_dir" not in env  # never the checkout: .venv, runs/, tests
    assert env["env_vars"]["NCCL_SOCKET_IFNAME"] == "ib0"
    assert int(env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 30


# ---- a launch crosses to the cluster as its own command line ----------------------------------


def parse_launch(args: list[str]) -> dict:
    """What `raytrain launch ARGS` would run, parsed by the real command, without running it."""
    return typer.main.get_command(app).commands["launch"].make_context("launch", list(args)).params


def test_launch_entrypoint_keeps_the_script_args_and_ships_its_directory():
    script_args = ["--out", "/mnt/shared/out", "--workers", "9", "--name", "mine", "-m"]
    cfg, command, env = jobs.launch_job(
        ["-w", "2", "--storage-path", "/mnt/shared/runs", str(SCRIPT), *script_args], parse_launch
    )
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "raytrain_ddp", "launch"]
    assert words[-len(script_args):] == script_args  # after the script, all is the script's
    params = parse_launch(words[4:])
    assert (params["workers"], params["storage_path"], params["name"]) == ("2", "/mnt/shared/runs", cfg.name)
    assert re.fullmatch(r"run-\d{8}-\d{6}", cfg.name)
    assert params["script"] == "torchrun_train.py"  # the job's driver starts in its copy of working_dir
    assert list(params["args"]) == script_args
    assert Path(env["working_dir"]) == SCRIPT.parent
    assert set(SHIP_EXCLUDES) <= set(env["excludes"])
    [package] = env["py_modules"]
    assert Path(package) == REPO / "raytrain_ddp"


def test_launch_of_a_module_ships_its_root(monkeypatch):
    monkeypatch.chdir(REPO / "tests")
    monkeypatch.setattr(sys, "path", list(sys.path))  # find_target adds the cwd, as `python -m` does
    launch = ["--storage-path", "/runs", "--name", "a", "-m", "scripts.torchrun_train", "-x"]
    cfg, command, env = jobs.launch_job(launch, parse_launch)
    assert shlex.split(command)[4:] == launch  # the user's line: -m MODULE as typed, the name already given
    assert Path(env["working_dir"]) == REPO / "tests"
    assert jobs.run_dir(cfg) == "/runs/a"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["launch", "-w", "2", str(SCRIPT)], ["--storage-path ./runs is relative", "--storage-path /mnt/shared/runs"]),
        (["launch", "--storage-path", "runs", str(SCRIPT)], ["--storage-path runs is relative"]),
        (["launch", "--address", "10.0.0.1:6379", "--storage-path", "/runs", str(SCRIPT)],
         ["--address 10.0.0.1:6379 in the launch command", "before `launch`"]),
        ([str(SCRIPT), "--lr", "3"], [f"not '{SCRIPT}'", "launch -w 2"]),
        (["--epochs", "5", "launch", "--storage-path", "/runs", str(SCRIPT)],
         ["--epochs is a run option", "either run options or a launch command"]),
    ],
)
def test_bad_launch_submissions_are_one_line(args, fragments):
    assert_refused(raytrain("submit", "--address", "http://127.0.0.1:1", "--dry-run", *args, timeout=60), *fragments)


# ---- address and token -------------------------------------------------------------------------


def test_address_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address, as on Slurm: not ours
    with pytest.raises(ConfigError, match="--address http://HEAD:8265"):
        jobs.dashboard_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265/")
    assert jobs.dashboard_address(None) == "http://head:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "https://ray.example.com")
    assert jobs.dashboard_address(None) == "https://ray.example.com"
    assert jobs.dashboard_address("head:8265") == "http://head:8265"
    with pytest.raises(ConfigError, match="not a dashboard URL"):
        jobs.dashboard_address("ray://head:10001")


def test_token_comes_from_the_variables_ray_reads(monkeypatch, tmp_path):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    assert jobs.auth_headers() == {}
    token = tmp_path / "token"
    token.write_text("abc\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert jobs.auth_headers() == {"Authorization": "Bearer abc"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "xyz")  # Ray's order: the variable beats the file
    assert jobs.auth_headers() == {"Authorization": "Bearer xyz"}
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot read RAY_AUTH_TOKEN_PATH"):
        jobs.auth_headers()


def test_no_dashboard_fails_fast_in_one_line():
    started = time.monotonic()
    proc = raytrain("status", "--address", f"http://127.0.0.1:{free_port()}", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 30
    [line] = proc.stderr.strip().splitlines()
    assert "no Ray dashboard answers" in line and "Connection refused" in line


# ---- a real Ray head with its dashboard -------------------------------------------------------


@dataclass
class DashboardHead:
    url: str
    env: dict[str, str]
    """A client's environment: the head's token, and no RAY_ADDRESS of its own."""


@pytest.fixture(scope="module")
def dashboard_head():
    try:
        import aiohttp  # noqa: F401  the dashboard and the Jobs client come with ray[default]
    except ImportError:
        pytest.fail("these tests need the Ray dashboard and Jobs client: pip install 'ray[default]'")
    with local_head(num_cpus=HEAD_CPUS, dashboard=True) as head:
        env = {k: v for k, v in head.env.items() if k != "RAY_ADDRESS"}
        yield DashboardHead(url=head.dashboard_url, env=env)


@pytest.mark.e2e
def test_submit_runs_the_job_and_reports_back(dashboard_head, tmp_path):
    runs = tmp_path / "runs"
    proc = raytrain(
        "submit", "--address", dashboard_head.url, *TINY, "--workers", "2",
        "--storage-path", str(runs), "--name", "submitted", env=dashboard_head.env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "done: 2 gloo workers" in proc.stdout  # the job's own output, streamed back
    job_id = re.search(r"submitted (\S+) to ", proc.stderr).group(1)
    assert f"job {job_id} SUCCEEDED" in proc.stderr
    summary = json.loads((runs / "submitted" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["epochs"] == 1

    status = raytrain("status", job_id, "--address", dashboard_head.url, env=dashboard_head.env)
    assert status.returncode == 0, status.stderr
    assert f"{job_id}: SUCCEEDED" in status.stdout
    assert f"run: submitted -> {runs}/submitted" in status.stdout
    listing = raytrain("status", "--address", dashboard_head.url, env=dashboard_head.env)
    assert re.search(rf"{job_id}\s+SUCCEEDED\s+submitted", listing.stdout), listing.stdout
    logs = raytrain("logs", job_id, "--address", dashboard_head.url, env=dashboard_head.env)
    assert logs.returncode == 0 and "done: 2 gloo workers" in logs.stdout


@pytest.mark.e2e
def test_submit_launch_runs_the_script_on_the_cluster(dashboard_head, tmp_path):
    out = tmp_path / "out"
    proc = raytrain(
        "submit", "--address", dashboard_head.url, "launch", "-w", "2", "--storage-path", str(tmp_path / "runs"),
        str(SCRIPT), "--out", str(out), "--epochs", "1", "--samples", "128", env=dashboard_head.env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "[rank0]: done: accuracy" in proc.stdout  # the launch's own output, streamed back
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert all(Path(r["cwd"]) != SCRIPT.parent for r in ranks)  # the shipped copy, not this checkout


@pytest.mark.e2e
def test_wrong_or_missing_token_is_refused_in_one_line(dashboard_head, tmp_path):
    base = {k: v for k, v in dashboard_head.env.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")}
    for env, says in (
        ({**base, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, "refused our auth token"),
        (base, "needs an auth token"),
    ):
        started = time.monotonic()
        proc = raytrain(
            "submit", "--address", dashboard_head.url, *TINY, "--storage-path", str(tmp_path),
            env=env, timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert time.monotonic() - started < 60
        [line] = proc.stderr.strip().splitlines()
        assert says in line and "RAY_AUTH_TOKEN_PATH" in line


@pytest.mark.e2e
def test_exit_status_is_the_jobs_failed_and_stopped(dashboard_head, tmp_path):
    address = ("--address", dashboard_head.url)
    # The cluster's driver refuses the request (exit 2); submit exits with the same status.
    bad = raytrain("submit", *address, *TINY, "--model", "nope", "--storage-path", str(tmp_path),
                   env=dashboard_head.env)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "unknown --model 'nope'" in bad.stdout and " FAILED: " in bad.stderr

    started = raytrain("submit", *address, *TINY, "--epochs", "50", "--no-wait",
                       "--storage-path", str(tmp_path), env=dashboard_head.env)
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    stop = raytrain("stop", job_id, *address, env=dashboard_head.env)
    assert stop.returncode == 0 and f"stopping {job_id}" in stop.stderr, stop.stderr
    followed = raytrain("logs", job_id, "--follow", *address, env=dashboard_head.env, timeout=180)
    assert followed.returncode == EXIT_INTERRUPTED, followed.stderr
    status = raytrain("status", job_id, *address, env=dashboard_head.env)
    assert f"{job_id}: STOPPED" in status.stdout
    unknown = raytrain("status", "raysubmit_nosuchjob", *address, env=dashboard_head.env)
    assert unknown.returncode == 2 and "no job raysubmit_nosuchjob" in unknown.stderr


# ---- the manifests -------------------------------------------------------------------------------


def load(path: str) -> list[dict]:
    return list(yaml.safe_load_all((REPO / "cluster" / path).read_text()))


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def token_from_secret(container: dict) -> bool:
    env = {e["name"]: e for e in container.get("env", [])}
    return (
        env.get("RAY_AUTH_MODE", {}).get("value") == "token"
        and "secretKeyRef" in env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {})
    )


def shared_claim(pod_template: dict) -> str:
    [claim] = [v["persistentVolumeClaim"]["claimName"] for v in pod_template["spec"]["volumes"]
               if "persistentVolumeClaim" in v]
    return claim


def test_raycluster_has_a_gpu_group_and_the_token_from_a_secret():
    [cluster] = load("kuberay/raycluster.yaml")
    [pvc] = load("kuberay/storage.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    head = cluster["spec"]["headGroupSpec"]
    assert all(token_from_secret(c) for c in containers(head["template"]))
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # pod network; token required
    [gpu] = cluster["spec"]["workerGroupSpecs"]
    [worker] = containers(gpu["template"])
    assert token_from_secret(worker)
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert shared_claim(head["template"]) == shared_claim(gpu["template"]) == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_rayjob_runs_raytrain_on_gpus_with_storage_on_the_shared_volume():
    [job] = load("kuberay/rayjob.yaml")
    assert job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["rayClusterSpec"]["authOptions"]["mode"] == "token"
    command = shlex.split(spec["entrypoint"])
    assert command[:2] == ["raytrain", "run"]
    cfg = parse_run_flags(command[2:])  # the real `run` command accepts every flag
    [gpu] = spec["rayClusterSpec"]["workerGroupSpecs"]
    [worker] = containers(gpu["template"])
    assert cfg.gpu and cfg.workers == gpu["replicas"] * int(worker["resources"]["limits"]["nvidia.com/gpu"])
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert cfg.storage_path.startswith(mounts["shared"] + "/")
    assert shared_claim(gpu["template"]) == shared_claim(spec["rayClusterSpec"]["headGroupSpec"]["template"])


def test_onprem_config_is_valid_for_the_cluster_launcher_and_uses_a_token():
    from raytrain_ddp.ray_compat.state import check_cluster_config

    [config] = load("onprem.yaml")
    check_cluster_config(config)  # what `ray up` checks first
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert any("pip install" in c and "~/raytrain/src" in c for c in config["setup_commands"])
    for start in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        assert "RAY_AUTH_MODE=token" in start and "RAY_AUTH_TOKEN_PATH=" in start
    assert "--dashboard-host=127.0.0.1" in config["head_start_ray_commands"][-1]
    header = (REPO / "cluster" / "onprem.yaml").read_text().split("cluster_name:")[0]
    assert f"> {config['file_mounts']['~/raytrain/auth_token']}" in header  # the usage makes the token
