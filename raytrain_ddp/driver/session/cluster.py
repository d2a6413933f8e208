"""Ray's view of the cluster this driver joined: its live nodes, what each has and has free, and who
holds the rest (placement groups and their makers)."""

from __future__ import annotations

import time

from raytrain_ddp.ray_compat.state import free_resources_per_node


def live_nodes() -> list[dict]:
    """The resources dict of each live node of the Ray cluster this process is connected to."""
    import ray

    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


SETTLE_S = 1.0
"""How long preflight reads again a cluster where something is held: resources given back (this
driver's previous run under `raytrain scale`, a job that just ended) reach Ray's view a moment later."""


def node_use(settle_s: float = 0.0) -> list[dict]:
    """Each live node as {"id", "ip", "total", "free"} (Ray resources dicts), for busy_problem; one
    record for the whole cluster, with no id or ip, where Ray tells only the cluster's free resources.
    While a CPU or GPU is held, read again for up to `settle_s`."""
    import ray

    deadline = time.monotonic() + settle_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        free = free_resources_per_node()
        if "" in free:
            total: dict[str, float] = {}
            for node in alive:
                for name, n in node["Resources"].items():
                    total[name] = total.get(name, 0) + n
            use = [{"id": "", "ip": "", "total": total, "free": free[""]}]
        else:
            # A node not in Ray's view of free resources yet cannot take a worker yet either.
            use = [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "total": n["Resources"], "free": free[n["NodeID"]]}
                   for n in alive if n["NodeID"] in free]
        held = any(n["free"].get(kind, 0) < n["total"].get(kind, 0) for n in use for kind in ("CPU", "GPU"))
        if not held or time.monotonic() >= deadline:
            return use
        time.sleep(0.2)


def placement_groups() -> list[dict]:
    """Every placement group of the cluster, as ray.util.placement_group_table() lists it, with who
    made it ("creator", in words) where the GCS's records tell."""
    import ray

    from raytrain_ddp.ray_compat.state import placement_group_creators

    creators = placement_group_creators()
    table = ray.util.placement_group_table()
    return [{**group, "creator": creators.get(hex_id)} for hex_id, group in table.items()]
