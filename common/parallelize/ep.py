"""Expert parallelism, applied from outside the model: each of the W ranks holds
n_experts / W of every MoE layer's experts, and the tokens travel to their experts.

``apply_ep`` (torchtitan's order: experts first, then the dense part's data parallelism)
turns each layer's expert stacks into DTensors split by expert over the mesh, so that
``init_weights``, checkpoints, ``--save-weights`` and the global gradient norm treat them
like any sharded weight, and wraps the experts' forward in two all-to-alls:

    dispatch: every rank sends each token slot (a token and one of its top_k choices) to
              the rank that owns the chosen expert;
    experts:  each rank runs its own experts on what it received (one grouped matmul);
    combine:  the results go back to the ranks the tokens came from, by the same route
              reversed, where the MoE layer weighs them and adds them up per token.

Dropless routing sends a different number of slots to each rank at every step, so the
counts travel first (a small all-to-all of n_experts integers): each rank then knows how
many rows it will receive from every other, the split sizes ``all_to_all_single`` needs.
Reading them on the host (``tolist``) waits for the device, the price of dropping nothing.

A dry run (one rank alone on the fake process group, ``--fake-world-size``) receives no
counts: the all-to-all of counts runs, and is counted, but fills nothing in. ``apply_ep(...,
even_routing=True)`` has the rank assume instead that every rank sends it as many token
slots as it sends that rank: its experts then receive top_k x its tokens, the mean load,
which is what formulas.ep_comm's formula assumes, so the dry run's shapes and all-to-all
bytes are those of a rank in a balanced real run.

The experts are spread over the data-parallel ranks (by default EP degree = world size, the
usual layout inside a node): a rank trains on its own share of the batch like any data-
parallel rank, and its experts see the tokens of every rank of its group. So an expert's
gradient is already the sum over the group's losses, where the dense part's is one rank's,
which FSDP then averages: dividing the experts' gradients by W makes both the gradient of
the global-batch mean loss. With ``--ep`` E below the world size the ranks form W/E groups,
each holding every expert once, and the copies of an expert all-reduce its gradient
(``reduce_expert_grads``), as DDP would.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from common.errors import UserError
from common.measure.comm import purpose
from common.model import MoE


def add_ep_flag(p) -> None:
    """--ep: the expert-parallel degree."""
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel degree: each group of this many ranks splits the experts among them, and "
                        "the groups are copies of each other (default: all the ranks, one group)")


def say_even_routing(ctx) -> None:
    """What a dry run's rank assumes of the routing it never receives (said once, by rank 0)."""
    if ctx.fake:
        ctx.print("dry run: the other ranks' routing never arrives, so this rank assumes an even one (each rank "
                  "sends it as many token slots as it sends that rank): its all-to-all bytes and expert shapes "
                  "are a balanced run's.")


def check_ep(cfg, model_name: str, ep: int, world: int | None = None, dry_run: bool = False) -> None:
    """Refuse what expert parallelism cannot split (one sentence, shared with tools/estimate.py;
    ``dry_run``: the ranks are --fake-world-size's, not launched)."""
    if world is not None and not (0 < ep <= world and world % ep == 0):
        raise UserError(f"--ep {ep} does not divide the {world} ranks into groups that each hold every expert; "
                        f"use a divisor of {world}.")
    if not cfg.n_experts:
        raise UserError(f"--model {model_name} has no experts to spread over the ranks; use a mixture-of-experts "
                        f"preset (debug-moe, small-moe, 1b-moe).")
    if cfg.n_experts % ep:
        raise UserError(f"the model's {cfg.n_experts} experts do not split evenly over {ep} expert-parallel ranks; "
                        f"{'use a --fake-world-size' if dry_run else 'launch a number of ranks'} that divides "
                        f"{cfg.n_experts}.")


def moe_layers(model: nn.Module) -> list[MoE]:
    layers = model.layers.values() if getattr(model, "layers", None) is not None else []
    return [block.feed_forward for block in layers if isinstance(block.feed_forward, MoE)]


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The experts' weights: what data parallelism must leave alone under expert parallelism."""
    return {p for moe in moe_layers(model) for p in moe.experts.parameters()}


def apply_ep(model: nn.Module, mesh: DeviceMesh, even_routing: bool = False) -> nn.Module:
    """Split every MoE layer's experts over ``mesh`` and route tokens with all-to-all (call
    it on a meta-device model, before data parallelism wraps the dense part).

    ``mesh``: 1-D, the experts split over all the ranks; or 2-D (replicate, ep), the
    experts split over each group of ep ranks and the groups copies of each other, which
    average their experts' gradients (``reduce_expert_grads``) as DDP would.
    ``even_routing``: for a dry run, assume the routing instead of exchanging it (module
    docstring)."""
    ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
    group, ep, w = ep_mesh.get_group(), ep_mesh.size(), mesh.size()
    if w == 1:
        return model  # one rank holds every expert: nothing to send anywhere
    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]  # n_experts / ep each
    for moe in moe_layers(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(distribute_tensor(p.data, mesh, placements)))
        experts.forward = partial(_dispatch_compute_combine, experts, experts.forward, group, ep, w,
                                  even_routing=even_routing)
        moe.global_counts = partial(_sum_counts, group=dist.group.WORLD)  # the whole global batch
    return model


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    """After the last backward of a step: copies of the same experts (a 2-D mesh, ep below
    the world size) sum their gradients, DDP's all-reduce for the experts. (Each copy's
    gradient is already divided by the world size.) Nothing to do on a 1-D mesh. In the
    model's order, the same on every rank: a set's order differs between processes, and
    two ranks would sum w1 with w3."""
    if mesh.ndim != 2 or mesh["replicate"].size() == 1:
        return
    with purpose("expert grads"):
        for moe in moe_layers(model):
            for p in moe.experts.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad.to_local(), group=mesh["replicate"].get_group())


def _sum_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Tokens per expert over the whole global batch, for the load-balancing loss."""
    with purpose("router counts"):
        return funcol.all_reduce(counts, "sum", group).clone()


def _mean_over_ranks(experts: nn.Module, w: int) -> None:  # w: all the ranks, whatever ep
    """Divide the experts' gradients by W as backward writes them: the sum over the W ranks'
    losses becomes their mean (module docstring). Hooked at the first forward, not in
    apply_ep: ``to_empty`` and loading a checkpoint put new parameters in place."""
    for p in experts.parameters():
        if not getattr(p, "_ep_mean", False):
            p.register_hook(lambda g: g / w)
            p._ep_mean = True


def _dispatch_compute_combine(experts, local_experts, group, w: int, world: int, x: torch.Tensor,
                              counts: torch.Tensor, even_routing: bool = False) -> torch.Tensor:
    """x: this rank's token slots grouped by expert (counts[e] for expert e, all n_experts);
    returns the experts' outputs for them, in the same order. ``w``: the ranks of ``group``
    (the expert-parallel degree)."""
    _mean_over_ranks(experts, world)
    n_local = counts.numel() // w
    with purpose("expert counts"):  # received[r, e]: slots rank r sends to my local expert e
        received = funcol.all_to_all_single(counts, None, None, group).view(w, n_local).clone()
    if even_routing:  # a dry run: nothing was received; assume rank r sends me what I send it
        received = counts.view(w, n_local).clone()
    send = counts.view(w, n_local).sum(dim=1).tolist()  # rows to each rank (its experts are consecutive)
    recv = received.sum(dim=1).tolist()
    routed = funcol.all_to_all_single_autograd(x, recv, send, group)  # dispatch
    # What arrived is grouped by source rank, then by expert: regroup by expert for the kernel.
    expert = torch.arange(n_local, device=x.device).repeat(w).repeat_interleave(received.flatten())
    by_expert = expert.argsort(stable=True)
    y = local_experts(routed[by_expert], received.sum(dim=0))
    y = y[by_expert.argsort()]  # back in arrival order
    return funcol.all_to_all_single_autograd(y, send, recv, group)  # combine: the reverse route


def ep_bytes_per_step(cfg, tokens_per_rank: int, received_rows: float | None = None, act_bytes: int = 4,
                      accum: int = 1) -> float:
    """Logical all-to-all bytes a rank sends per optimizer step (the token rows, not the counts).

    Per MoE layer and micro-batch: the dispatch sends this rank's k * T slots, the combine
    sends back the R rows its experts received, and backward does both again reversed:
    2 (kT + R) rows of ``dim`` values. R depends on the routing (pass the measured mean);
    its mean over the ranks is kT, so the mean over the ranks is exactly 4 kT rows.
    """
    k_t = cfg.top_k * tokens_per_rank
    rows = 2 * (k_t + (k_t if received_rows is None else received_rows))
    return cfg.n_layers * accum * rows * cfg.dim * act_bytes
