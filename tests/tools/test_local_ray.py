"""The private Ray heads that tests and benchmarks start (bench/local_ray.py): a `ray start` that
exits before its head is up (a port taken between picking it and binding it) is tried again with
fresh ports, and one that never comes up says what `ray start` said."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from raytrain_ddp.bench.local_ray import local_head
from raytrain_ddp.driver.session.head import START_TRIES, NodeExited, free_ports

TAKEN = "Failed to bind to address 127.0.0.1:{port}: Address already in use"


def flaky_ray(folder: Path, failures: int) -> Path:
    """A `ray` command whose first `failures` starts exit 1 as a taken port makes Ray's do; after
    that, the real `ray`. Each start's arguments go to folder/tries."""
    script = folder / "ray"
    script.write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n"
        f'echo "$*" >> {folder / "tries"}\n'
        f'if (( $(wc -l < {folder / "tries"}) <= {failures} )); then\n'
        f'  echo "{TAKEN.format(port="$RANDOM")}" >&2\n  exit 1\nfi\n'
        f'exec {Path(sys.executable).with_name("ray")} "$@"\n'
    )
    script.chmod(0o755)
    return script


def test_free_ports_are_different_and_outside_the_ephemeral_range():
    ports = free_ports("127.0.0.1", 50)
    assert len(set(ports)) == 50
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(port < min(low, 20000) for port in ports)  # 20000 on: the worker-port blocks


def test_a_head_whose_ray_start_exits_is_started_again_on_fresh_ports(tmp_path):
    with local_head(num_cpus=1, ray=str(flaky_ray(tmp_path, failures=1))) as head:
        host, port = head.address.split(":")
        socket.create_connection((host, int(port)), timeout=5).close()
    tries = (tmp_path / "tries").read_text().splitlines()
    assert len(tries) == 2
    first, second = ({arg for arg in t.split() if arg.startswith("--port=")} for t in tries)
    assert first != second


def test_a_head_that_never_comes_up_says_what_ray_start_said(tmp_path):
    with pytest.raises(NodeExited, match=rf"exited with 1 \({START_TRIES} tries.*Address already in use"):
        with local_head(num_cpus=1, ray=str(flaky_ray(tmp_path, failures=START_TRIES))):
            pass
    assert len((tmp_path / "tries").read_text().splitlines()) == START_TRIES
