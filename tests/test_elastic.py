"""Which nodes an elastic restart counts. The restarts themselves, after a drain and after a killed
node, are the end-to-end tests in test_cluster.py and test_slurm.py."""

from __future__ import annotations

import socket

import pytest

from raytrain_ddp import ray_compat

pytestmark = pytest.mark.skipif(not ray_compat.supports("elastic"), reason="Ray < 2.55 has no elastic runs")


def test_a_node_answers_while_its_raylet_port_listens_and_not_once_it_is_closed():
    from raytrain_ddp.ray_compat.elastic import answers

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()  # never accepts: the kernel does, as for a raylet too busy to
    node = {"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": server.getsockname()[1]}
    try:
        assert answers(node)
    finally:
        server.close()
    assert not answers(node)  # a killed raylet: refused at once
