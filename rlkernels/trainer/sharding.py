"""The update's forward over the ranks of torchrun (`update_engine`): DistributedDataParallel, or FSDP2
(`fully_shard`) for `--fsdp`, where each rank holds 1/N of the weights, gradients and optimizer state
(docs/design.md §10).

Units: every decoder layer (the classes a Hugging Face model names in `_no_split_modules`, also those
of PPO's separate critic trunk), then a root that holds the rest: the update's `UpdateForward` (the
embeddings, final norm, lm_head and critic head; the loss head reads `lm_head.weight` inside its
forward, where FSDP has gathered it, and the gradient reaches the sharded parameter through FSDP's
reduce-scatter), and the reference model on its own. Generation, scoring and evaluation read the
root's parameters outside its forward: `gathered` runs them as a forward of the root. Gradients are
summed over ranks, not averaged: the loss is already this rank's share of a global sum.

Checkpoints hold whole tensors in the layout of a run without FSDP (parameters numbered as torch's
optimizer numbers them), so a run resumes with or without `--fsdp`, on any number of ranks.
"""
from __future__ import annotations

import copy
import functools
import re
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from .distributed import dist_info

# whole tensors, on rank 0's CPU only (the other ranks get {}): a checkpoint never needs a whole copy on a device
WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)
RUN = "fsdp_run"  # the root's method that `gathered` calls, registered as a forward with FSDP


def layer_types(root: nn.Module) -> set:
    """Class names of the decoder layers of the Hugging Face models in `root`."""
    names = set()
    for module in root.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"--fsdp: {type(root).__name__} holds no Hugging Face model that names its decoder layers "
                         f"(_no_split_modules), which FSDP shards one by one")
    return names


def _run(fn):
    return fn()


def shard(root: nn.Module, device: torch.device) -> nn.Module:
    """`fully_shard` every decoder layer in `root`, then `root` (in place); returns it."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    names = layer_types(root)
    for module in list(root.modules()):
        if type(module).__name__ in names:
            fully_shard(module, mesh=mesh)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    setattr(root, RUN, _run)
    register_fsdp_forward_method(root, RUN)
    # the update returns views (the fused ops' loss, the critic's squeezed values), never changed in place
    warnings.filterwarnings("ignore", message=re.escape(f"FSDP2-wrapped module ({type(root).__name__}) returned a view"))
    return root


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def gathered(root: nn.Module, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` without gradients, as a forward of the FSDP root `root`: its own parameters
    (embeddings, final norm, head) gathered throughout, each decoder layer's while it runs; the first such
    forward also sets FSDP up, which must happen at the root before any layer runs. A plain call otherwise."""
    if not isinstance(root, FSDPModule):
        return fn(*args, **kwargs)
    with torch.no_grad():
        try:
            return getattr(root, RUN)(functools.partial(fn, *args, **kwargs))
        finally:
            root.reshard()  # a root keeps its parameters after a forward, for the backward: none follows


def full_state_dict(module: nn.Module) -> dict:
    """`module.state_dict()`; sharded, with whole tensors on rank 0 ({} elsewhere): every rank must call it."""
    return get_model_state_dict(module, options=WHOLE) if is_sharded(module) else module.state_dict()


def load_state_dict(module: nn.Module, state: dict) -> None:
    """`module.load_state_dict(state)` of whole tensors; sharded, each rank keeps its shard."""
    if is_sharded(module):
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))
    else:
        module.load_state_dict(state)


def _names(root: nn.Module, optimizer) -> list:
    """The name in `root` of each parameter, in the optimizer's order (its state dict numbers them so)."""
    names = {p: n for n, p in root.named_parameters()}
    return [names[p] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_dict(root: nn.Module, optimizer) -> dict:
    """`optimizer.state_dict()`; sharded, with whole tensors on rank 0 ({} elsewhere), numbered as without FSDP.
    Before the first step there is nothing to gather (torch's full state dict would take a zero step to make it)."""
    if not is_sharded(root) or not optimizer.state:
        return optimizer.state_dict()
    state = get_optimizer_state_dict(root, optimizer, options=WHOLE)
    if not state:
        return state
    index = {name: i for i, name in enumerate(_names(root, optimizer))}
    return {"state": {index[name]: s for name, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def load_optimizer_state_dict(root: nn.Module, optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)` of whole tensors; sharded, each rank keeps its shards."""
    if not is_sharded(root) or not state["state"]:
        optimizer.load_state_dict(state)
        return
    names = _names(root, optimizer)
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(root, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with its parameters on the meta device (no memory) and its buffers on the CPU: the
    unsharded model that `with_weights` fills. Taken before sharding (FSDP modules refuse deepcopy)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
    memo.update({id(b): b.to("cpu", copy=True) for b in model.buffers()})
    return copy.deepcopy(model, memo)


def with_weights(meta: nn.Module, state: dict) -> nn.Module:
    """An unsharded CPU model: a copy of `meta` (from `meta_copy`) holding the whole weights of `state`."""
    model = copy.deepcopy(meta)
    model.load_state_dict(state, assign=True)
    return model


def _summed(group, bucket):
    """DDP communication hook: gradients summed over ranks (DDP's own hook averages them, which would
    shrink every update by the world size, as the loss is already Σ_rank / N_global)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def update_engine(forward, place, find_unused: bool, fsdp: bool = False):
    """`forward` as it runs the update: itself in one process, wrapped in DistributedDataParallel under
    torchrun, or with `fsdp` sharded by FSDP2 (in place; `shard`). `find_unused`: some rank may train
    on an empty mini-batch (dynamic sampling keeps unequal numbers of groups per rank)."""
    if dist_info()[1] == 1:
        return forward
    if fsdp:
        return shard(forward, place.device)
    ids = [place.device.index] if place.device.type == "cuda" else None
    # no buffer broadcast per forward: the models' buffers (rotary tables) are constants
    ddp = nn.parallel.DistributedDataParallel(forward, device_ids=ids, forward_sync_buffers=False,
                                              find_unused_parameters=find_unused)
    ddp.register_comm_hook(None, _summed)
    return ddp
