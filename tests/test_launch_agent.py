"""torchrun's environment for each rank, from where Ray placed the ranks (a pure function)."""

from __future__ import annotations

from raytrain_ddp.launch_agent import exit_status, torchrun_env


def peer(rank: int, node_rank: int, local_rank: int, gpus: list[str], ip: str, port: int | None = None) -> dict:
    return {"rank": rank, "node_rank": node_rank, "local_rank": local_rank, "gpus": gpus, "ip": ip, "port": port}


# Two nodes of two GPUs each. Ray gave rank 1 the node's GPU 5 and rank 0 its GPU 2.
PEERS = [
    peer(0, 0, 0, ["2"], "10.0.0.1", 29517),
    peer(1, 0, 1, ["5"], "10.0.0.1"),
    peer(2, 1, 0, ["0"], "10.0.0.2"),
    peer(3, 1, 1, ["1"], "10.0.0.2"),
]


def test_ranks_nodes_and_rendezvous():
    env = torchrun_env(3, PEERS, attempt=2, max_restarts=3, run_id="exp")
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29517")  # rank 0's node and port
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert all(isinstance(v, str) for v in env.values())


def test_cuda_local_rank_is_the_ranks_own_gpu():
    # Each rank sees its node's GPUs in local-rank order, so cuda:LOCAL_RANK is the GPU Ray gave it.
    for rank in range(4):
        env = torchrun_env(rank, PEERS, attempt=1, max_restarts=0, run_id="exp")
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["LOCAL_RANK"])] == PEERS[rank]["gpus"][0]
    assert torchrun_env(1, PEERS, 1, 0, "exp")["CUDA_VISIBLE_DEVICES"] == "2,5"


def test_cpu_ranks_get_no_cuda_devices():
    cpu = [peer(0, 0, 0, [], "10.0.0.1", 1234), peer(1, 0, 1, [], "10.0.0.1")]
    assert "CUDA_VISIBLE_DEVICES" not in torchrun_env(1, cpu, 1, 0, "exp")


def test_exit_status_as_a_shell_reports_it():
    assert exit_status(3) == 3 and exit_status(0) == 0
    assert exit_status(-9) == 137 and exit_status(-15) == 143
