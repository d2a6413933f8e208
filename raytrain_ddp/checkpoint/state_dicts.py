"""The model's and optimizer's state dicts under either strategy, got for a checkpoint and set from
one: whole under DDP (rank 0 saves them into STATE), this rank's shards under FSDP (every rank saves
them into SHARDS with DCP). Either loads into either strategy, at any world size.

FSDP and DCP are imported where they are used: torch.distributed.tensor alone takes about a second
to import, and only a checkpoint needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(model, optimizer) state dicts whole, the format of a DDP checkpoint's STATE (rank 0 saves
    them), or None under FSDP, whose state goes to sharded files (sharded_state)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return None
    return getattr(model, "module", model).state_dict(), optimizer.state_dict()


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, keyed by parameter name, as DCP saves
    and loads them (any world size, any strategy)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load DCP files into this rank's model and optimizer, whatever world size or strategy saved
    them: DCP reads the pieces of every saved shard that this rank's own shards cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load whole state dicts (a DDP checkpoint's STATE, every rank has them) into the model and
    optimizer; under FSDP each rank keeps its shard of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        getattr(model, "module", model).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=whole)
    # optimizer.state_dict() numbers the parameters in param_groups order; DCP's names them
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    named = {
        "state": {order[i]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, named, options=whole)


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict on every rank (an all-gather under FSDP), for tests and export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """A state dict's tensor shapes, for RESUME_INFO: the driver checks a rerun's model against them."""
    return {key: list(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}
