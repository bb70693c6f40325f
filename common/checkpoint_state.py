"""The state a checkpoint holds, in a form that does not depend on the layout: a rank's parts
merged into one module by parameter name (``_union``), the optimizer's state dict flattened to
keys by parameter name and back (``_flatten_optim``, ``_unflatten_optim``), a learning-rate
schedule's per-group lists fitted to another number of groups (``per_group``); and, for
``--ckpt-async``, the bytes of this rank's state (``_local_bytes``) and the stager that copies
it to host memory and hands the copy to the memory tracer (``_stager``)."""
from __future__ import annotations

import inspect

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor


def _stager(on_staged):
    """DCP's default stager for async_save (a plain copy to host memory, made before
    async_save returns), which also hands the copy to ``on_staged`` (the memory tracer's
    "checkpoint staging"). None where this torch has no such class: async_save's own then."""
    if on_staged is None or "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # an older torch (the GPU machines run 2.11): async_save's own stager, untraced
        return None

    class Stager(DefaultStager):
        def stage(self, state_dict, **kwargs):
            staged = super().stage(state_dict, **kwargs)
            on_staged(staged)
            return staged

    return Stager(StagingOptions(False, False, False, False))  # what async_save builds when given none


def _local_bytes(state) -> int:
    """Bytes of the tensors this rank holds in a state dict (its shards of DTensors)."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _union(modules) -> torch.nn.Module:
    """One module whose parameters are those of ``modules``, under their own names.

    Pipeline stages keep the full model's names (``layers.5...``), and one rank's stages
    own disjoint layers, so their children merge without a clash (ModuleDicts by key).
    """
    if len(modules) == 1:
        return modules[0]
    union = torch.nn.Module()
    for m in modules:
        for name, child in m.named_children():
            if child is None:
                continue
            have = getattr(union, name, None)
            if isinstance(child, torch.nn.ModuleDict) and isinstance(have, torch.nn.ModuleDict):
                have.update(child)
            elif have is None:
                setattr(union, name, torch.nn.ModuleDict(child) if isinstance(child, torch.nn.ModuleDict) else child)
            else:
                raise ValueError(f"two stages of one rank both hold {name!r}")
    return union


def per_group(scheduler_state: dict, groups: int) -> dict:
    """A learning-rate schedule's saved state with one entry a group for ``groups`` groups.
    The schedule keeps a list per parameter group (base_lrs, the last lrs, the lambdas'
    state), and layouts have different numbers of groups (common/training.py: one per kind of
    parameter; TP two, DDP one). Every group runs the same schedule, so the first entry
    serves them all; a list left at the saving layout's length would leave a group's
    learning rate behind, or fail."""
    state = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(state.get(key), list) and state[key] and len(state[key]) != groups:
            state[key] = state[key][:1] * groups
    return state


def _flatten_optim(sd: dict) -> dict:
    """{'state': {fqn: {...}}, 'param_groups': [...]} -> flat keys, mergeable across parts."""
    flat = {f"state.{fqn}.{k}": v for fqn, st in sd["state"].items() for k, v in st.items()}
    for i, group in enumerate(sd["param_groups"]):
        for fqn in group["params"]:
            flat[f"param_groups.{fqn}"] = {k: v for k, v in group.items() if k != "params"} | {"_group": i}
    return flat


def _unflatten_optim(flat: dict) -> dict:
    state, groups = {}, {}
    for key, v in flat.items():
        if key.startswith("state."):
            fqn, k = key[len("state."):].rsplit(".", 1)
            state.setdefault(fqn, {})[k] = v
        else:
            fqn = key[len("param_groups."):]
            g = dict(v)
            i = g.pop("_group")
            groups.setdefault(i, dict(g, params=[]))["params"].append(fqn)
    return {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}
