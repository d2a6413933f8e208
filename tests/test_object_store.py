"""Runs on an object store (storage/): `--storage-path s3://...` against a real S3 server (moto's
server mode), with the same readers and writers as a local run directory; its faults in one line
each; and the lease that keeps a second driver off a run there."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, free_port, raytrain, refusal

from raytrain_ddp.checkpoint.files import RESUME_INFO, STATE, rank_file, resume_choice
from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.plan import run_lock
from raytrain_ddp.storage.location import ANSWER_S, check_store, storage_root
from raytrain_ddp.storage import staged
from raytrain_ddp.storage.object_path import ObjectPath
from raytrain_ddp.storage.staged import StagedDir


def fresh_prefix(name: str) -> str:
    return f"s3://runs/{name}-{time.time_ns()}"


def torch_file(value: int) -> bytes:
    out = io.BytesIO()
    torch.save({"model": torch.arange(1000) + value}, out)
    return out.getvalue()


def test_an_object_path_reads_and_writes_as_a_path_does(store_env):
    root = storage_root(fresh_prefix("paths"))
    assert isinstance(root, ObjectPath) and str(root).startswith("s3://runs/paths-")
    run = root / "r1"
    assert not run.exists() and not run.is_dir() and list(run.iterdir()) == []
    run.mkdir(parents=True, exist_ok=True)  # a prefix: nothing to make
    (run / "summary.json").write_text('{"a": 1}')
    (run / "checkpoint_000001" / STATE).write_bytes(b"x" * 10)
    assert run.is_dir() and (run / "summary.json").is_file() and json.loads((run / "summary.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_000001", "summary.json"]
    assert [p.name for p in run.glob("checkpoint_*")] == ["checkpoint_000001"]
    assert (run / "checkpoint_000001" / STATE).stat().st_size == 10
    with pytest.raises(FileNotFoundError):
        (run / "missing.json").read_text()
    aside = run.rename(run.with_name("r1.old"))  # every object under it, copied by the store, then deleted
    assert not run.exists() and (aside / "checkpoint_000001" / STATE).read_bytes() == b"x" * 10


def test_the_resume_takes_the_newest_whole_checkpoint_from_the_store(store_env):
    """A checkpoint's files are checked by their zip central directory, through ranged reads: a
    truncated newest one is skipped, by name and why, as on disk."""
    run = storage_root(fresh_prefix("resume")) / "r"
    for name, cut in (("checkpoint_2026-11-29_01-00-00.000001", False), ("checkpoint_2026-11-29_02-00-00.000001", True)):
        (run / name / RESUME_INFO).write_text(json.dumps({"world_size": 1, "epoch": 1, "position": 0}))
        state = torch_file(1)
        (run / name / STATE).write_bytes(state[: len(state) // 2] if cut else state)
        (run / name / rank_file(0)).write_bytes(torch_file(2))
    choice = resume_choice(run)
    assert choice.checkpoint == run / "checkpoint_2026-11-29_01-00-00.000001"
    [(skipped, why)] = choice.skipped
    assert skipped == "checkpoint_2026-11-29_02-00-00.000001" and STATE in why, why


def test_staged_files_are_copied_up_every_keep_s_and_at_the_end(store_env, monkeypatch):
    """What a killed process keeps of a growing file (launch's rank logs, a trial's log): the lines up
    to the last copy, KEEP_S apart; a relaunch appends to what is there, as on disk; a store that
    refuses costs the copy, said once, and the local copies stay, named."""
    monkeypatch.setattr(staged, "KEEP_S", 0.5)
    remote = storage_root(fresh_prefix("staged")) / "t" / "logs"
    said: list[str] = []
    logs = StagedDir(remote, said.append)
    logs.open("rank-0.log").write("first\n")
    logs.keep()
    time.sleep(0.2)
    assert not (remote / "rank-0.log").exists()  # within KEEP_S of the start: not yet
    time.sleep(0.4)
    logs.keep()  # copied behind the caller
    deadline = time.monotonic() + 10
    while not (remote / "rank-0.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert (remote / "rank-0.log").read_text() == "first\n"
    logs.open("rank-0.log").write("second\n")
    logs.open("rank-1.log").write("other\n")
    logs.close()
    assert (remote / "rank-0.log").read_text() == "first\nsecond\n" and (remote / "rank-1.log").read_text() == "other\n"
    assert not logs.local.exists() and said == []

    again = StagedDir(remote, said.append)
    again.open("rank-0.log").write("relaunched\n")
    again.close()
    assert (remote / "rank-0.log").read_text() == "first\nsecond\nrelaunched\n"

    gone = StagedDir(storage_root("s3://nobucket/t") / "logs", said.append)
    gone.open("rank-0.log").write("kept here\n")
    gone.keep(every_s=0)  # behind the caller: its failure is seen at a later keep
    deadline = time.monotonic() + 30
    while gone.behind.quiet()[1] is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    gone.keep(every_s=0)
    gone.keep(every_s=0)
    gone.close()
    assert (gone.local / "rank-0.log").read_text() == "kept here\n"
    assert len(said) == 2 and said[0].startswith("s3://nobucket/t/logs was not copied up (") and str(gone.local) in said[1]


def test_the_endpoint_comes_from_the_uri_or_the_environment(s3_server, monkeypatch):
    for key, value in s3_server.env.items():
        if key != "AWS_ENDPOINT_URL_S3":
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    in_uri = storage_root(f"s3://runs/uri?endpoint_override={s3_server.endpoint}")
    check_store(in_uri, f"s3://runs/uri?endpoint_override={s3_server.endpoint}")
    (in_uri / "x").write_text("1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    from_env = storage_root("s3://runs/uri")
    assert from_env.key == in_uri.key and (from_env / "x").read_text() == "1"
    assert storage_root("file:///tmp/x") == Path("/tmp/x") and storage_root("runs") == Path("runs").absolute()


def test_a_store_that_cannot_serve_the_run_is_named_in_one_line_within_seconds(store_env, monkeypatch):
    with pytest.raises(ConfigError, match=r"there is no bucket 'nobucket' at its store; create it"):
        check_store(storage_root("s3://nobucket/runs"), "s3://nobucket/runs")
    closed = free_port("127.0.0.1")  # nothing listens
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{closed}")
    with pytest.raises(ConfigError, match=r"cannot reach its store .*check the endpoint"):
        check_store(storage_root("s3://runs/x"), "s3://runs/x")
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"its store did not answer in {ANSWER_S:.0f} s"):
            check_store(storage_root("s3://runs/x"), "s3://runs/x")
        assert time.monotonic() - started < ANSWER_S + 5


HOLD = """
import sys, time
from raytrain_ddp.driver.plan import run_lock
from raytrain_ddp.storage.location import storage_root
run_lock.take(storage_root(sys.argv[1]) / "r")
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_driver_is_refused_while_the_lease_is_held_and_takes_it_once_its_holder_died(store_env, monkeypatch):
    monkeypatch.setattr(run_lock, "CONFIRM_S", 0.2)
    root = fresh_prefix("lease")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, root], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        run_dir = storage_root(root) / "r"
        with pytest.raises(ConfigError, match=rf"in use by another driver: pid {holder.pid} on .*its lease lapses 60 s"):
            run_lock.take(run_dir)
        holder.send_signal(signal.SIGKILL)  # no release: its lease stays, renewed no more
        holder.wait()
        assert json.loads((run_dir / run_lock.LOCK).read_text())["pid"] == holder.pid
        run_lock.take(run_dir)  # its process is gone from this host: taken over at once
        assert json.loads((run_dir / run_lock.LOCK).read_text())["pid"] == os.getpid()
        run_lock.release(run_dir)
        assert not (run_dir / run_lock.LOCK).exists()
    finally:
        holder.kill()


def test_bad_storage_is_refused_in_one_line_before_anything_starts(s3_server, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **s3_server.env}
    run = ["run", "--workers", "1", *TINY]
    assert "there is no bucket 'nobucket'" in refusal(raytrain(*run, "--storage-path", "s3://nobucket/x", env=env, cwd=tmp_path))
    assert "--mlflow keeps its sqlite store in the run directory" in refusal(
        raytrain(*run, "--storage-path", "s3://runs/x", "--mlflow", env={**env, "MLFLOW_TRACKING_URI": ""}, cwd=tmp_path))
    # A typo in the URI's query would send the run to AWS itself; keys in it would be printed and saved
    said = refusal(raytrain(*run, "--storage-path", "s3://runs/x?endpoint=http://127.0.0.1:9", env=env, cwd=tmp_path))
    assert "option 'endpoint' is not one of endpoint_override, region, scheme" in said, said
    said = refusal(raytrain(*run, "--storage-path", "s3://AKIAEXAMPLE:SeCrEt@runs/x", env=env, cwd=tmp_path))
    assert "s3://KEYS@runs/x: keys in the URI" in said and "SeCrEt" not in said and "AKIAEXAMPLE" not in said, said
    assert list(tmp_path.iterdir()) == []  # no `s3:` folder, as a URI taken for a local path made


AUTH_SERVER = """
import json, sys, time
import boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
kw = dict(endpoint_url=f"http://127.0.0.1:{sys.argv[1]}", region_name="us-east-1", aws_access_key_id="x",
          aws_secret_access_key="x")
boto3.client("iam", **kw).create_user(UserName="u")  # the 4 requests before moto asks for credentials
key = boto3.client("iam", **kw).create_access_key(UserName="u")["AccessKey"]
boto3.client("iam", **kw).put_user_policy(UserName="u", PolicyName="all", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
boto3.client("s3", **kw).create_bucket(Bucket="runs")
print(key["AccessKeyId"], flush=True)
time.sleep(600)
"""


def test_wrong_credentials_are_named_in_one_line(tmp_path):
    """A server that checks them (moto's, told to): the key is not one it knows."""
    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-c", AUTH_SERVER, str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        assert server.stdout.readline().strip()
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "AWS_ACCESS_KEY_ID": "WRONG",
               "AWS_SECRET_ACCESS_KEY": "WRONG", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_REGION": "us-east-1"}
        said = refusal(raytrain("run", "--workers", "1", *TINY, "--storage-path", "s3://runs/x", env=env, cwd=tmp_path))
        assert "access denied" in said and "AWS_ACCESS_KEY_ID" in said, said
    finally:
        server.kill()


SERVER = """
import sys, time
import boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}", region_name="us-east-1", aws_access_key_id="t",
             aws_secret_access_key="t").create_bucket(Bucket="runs")
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
def test_a_store_that_goes_away_mid_run_ends_it_in_one_line_within_seconds(ray_head, tmp_path):
    """The driver's files wait for the store (one warning line; the ranks train on); the checkpoint
    Ray cannot upload or register ends the run, in one line that says the store failed and how to resume."""
    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    run = None
    try:
        assert server.stdout.readline().strip() == "up"
        env = {**ray_head.env, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t",
               "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_REGION": "us-east-1"}
        run = subprocess.Popen([sys.executable, "-m", "raytrain_ddp", "run", "--workers", "2", "--epochs", "3",
                                "--train-samples", "4096", "--val-samples", "64", "--batch-size", "32", "--data-workers",
                                "0", "--checkpoint-every-steps", "8", "--progress", "plain", "--storage-path",
                                "s3://runs/gone", "--name", "g"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)
        deadline = time.monotonic() + 240
        for line in run.stdout:
            if line.startswith("start-up "):
                break
            assert time.monotonic() < deadline
        server.kill()
        gone = time.monotonic()
        out, err = run.communicate(timeout=120)
        ended_after = time.monotonic() - gone
    finally:
        server.kill()
        if run is not None and run.poll() is None:
            run.kill()
    assert run.returncode == 1, err[-2000:]
    said = err.strip().splitlines()[-1]
    assert said.startswith("error: ") and "the object store failed the run's files: When " in said, said  # a rank's, or the driver's
    assert "run the same command again to resume once it answers" in said, said
    assert run_lock.LOCK not in said, said  # the run's own failure, not the lease's release after it
    assert ended_after < 60, ended_after
    assert list(tmp_path.iterdir()) == []


def test_stack_finds_the_run_that_started_ranks_last_in_the_store(store_env):
    from raytrain_ddp.doctor.workers import WORKERS
    from raytrain_ddp.driver.look.stack import find_run

    root = storage_root(fresh_prefix("stack"))
    (root / "older" / WORKERS).write_text("{}")
    time.sleep(1.1)  # an object's time is the store's, to the second
    (root / "newer" / WORKERS).write_text("{}")
    (root / "no-ranks" / "summary.json").write_text("{}")
    assert find_run(root, None) == root / "newer" and find_run(root, "older") == root / "older"
    with pytest.raises(ConfigError, match="no running record of run gone"):
        find_run(root, "gone")


def test_a_ranks_profile_trace_goes_to_the_store(store_env, tmp_path):
    """--profile on an object store: the trace is written locally, copied up whole, and the local
    copy removed; the rank's line names where it went."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.worker.measure.profiling import Profiler

    root = fresh_prefix("profile")
    run_dir = storage_root(root) / "p"
    lines: list[str] = []
    profiler = Profiler(TrainConfig(profile="0:1:1", storage_path=root, name="p"), 0, torch.device("cpu"), 4,
                        lines.append, run_dir=run_dir)
    local = profiler.dir
    for _ in range(2):
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.step(0.0)
    profiler.finish()
    [trace] = (run_dir / "profile").glob("rank0.*.pt.trace.json")
    assert trace.stat().st_size > 0 and not local.exists()
    [line] = lines
    assert line.endswith(f"per step -> {run_dir / 'profile'}"), line


SILENT_PROXY = """
import asyncio, signal, sys
silent = False
async def pipe(reader, writer):
    while data := await reader.read(65536):
        while silent:  # a store that stops answering: the connection stays open, nothing comes back
            await asyncio.sleep(3600)
        writer.write(data)
        await writer.drain()
async def serve(reader, writer):
    while silent:
        await asyncio.sleep(3600)
    store = await asyncio.open_connection("127.0.0.1", int(sys.argv[1]))
    await asyncio.gather(pipe(reader, store[1]), pipe(store[0], writer), return_exceptions=True)
def hush():
    global silent
    silent = True
async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, hush)
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_store_that_stops_answering_holds_back_the_files_not_the_run(ray_head, s3_server, tmp_path):
    """A store that goes silent (a request then waits 60 s, tried 3 times): the epochs' lines go on,
    the driver says within about a minute that the store takes none of the run's files, and the
    ranks' end, waiting on Ray Train's upload of the last checkpoint, is said as that, not as a
    slow step."""
    proxy = subprocess.Popen([sys.executable, "-c", SILENT_PROXY, s3_server.endpoint.rsplit(":", 1)[1]],
                             stdout=subprocess.PIPE, text=True)
    run = None
    try:
        port = int(proxy.stdout.readline())
        env = {**ray_head.env, **s3_server.env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
        run = subprocess.Popen([sys.executable, "-m", "raytrain_ddp", "run", "--workers", "2", "--epochs", "8",
                                "--train-samples", "1024", "--val-samples", "64", "--batch-size", "32", "--data-workers",
                                "0", "--progress", "plain", "--storage-path", f"s3://runs/silent-{time.time_ns()}",
                                "--name", "s"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=tmp_path)
        said: list[tuple[float, str]] = []
        for line in run.stdout:
            said.append((time.monotonic(), line.strip()))
            if line.startswith("start-up "):
                proxy.send_signal(signal.SIGUSR1)
                hushed = time.monotonic()
            if line.startswith("the ranks finished training"):
                break
        else:
            pytest.fail("the run ended before its ranks' end was said:\n" + "\n".join(text for _, text in said))
        run.send_signal(signal.SIGINT)  # twice: at once, whatever the store
        time.sleep(1)
        run.send_signal(signal.SIGINT)
        second = time.monotonic()
        rest, _ = run.communicate(timeout=120)
        ended_after = time.monotonic() - second
    finally:
        proxy.kill()
        if run is not None:
            run.kill()
            run.communicate()
    after = [(at - hushed, text) for at, text in said if at > hushed]
    lines = "\n".join(f"{at:5.1f} s  {text}" for at, text in after)
    epochs = [at for at, text in after if text.startswith("epoch ") and " train loss " in text]
    gaps = [b - a for a, b in zip([0.0, *epochs], epochs)]
    assert len(epochs) == 8 and max(gaps) < 30, lines  # shown as they end, not held a request's 60 s (or 3) each
    [(warned, warning)] = [(at, text) for at, text in after if text.startswith("warning: the object store has taken none")]
    # The first write after the store went quiet is the first epoch's row: said 30 s on, within a minute
    assert 29 <= warned - epochs[0] < 60 and "(no answer yet); " in warning, lines  # training goes on, or the end waits
    assert not any(text.startswith("slow, not stuck") for _, text in after), lines
    assert run.returncode == 130 and ended_after < 10, (ended_after, rest)
    assert rest.strip().splitlines()[-1].startswith("stopped: stopped at once by a second Ctrl-C"), rest
