"""Context parallelism: ring attention, written by hand, applied to the model from outside.

Every rank of the ``cp`` group holds the whole model and a slice of every sequence. All of
a block runs token by token, so it needs nothing from the other slices, except attention:
a query attends to the keys and values of every earlier token, wherever they live. The
ring brings them over. In W steps each rank's key/value block travels once around the
ring of ranks; at each step a rank attends its queries to the block it holds (while the
next one is already on its way: the transfer hides behind the compute) and folds the
partial result into its running one with the online-softmax rescaling, the same merge
flash attention does across the tiles of one GPU. Backward goes around once more: the
key/value blocks again, each carrying the gradient of its keys and values, which the
ranks add to as it passes and which arrives home after W hops.

``apply_cp`` installs this in two places, and the model never knows:
- each ``Attention.sdpa`` (the kernel attribute, SDPA by default) becomes the ring;
- ``rope_for`` returns the rotary tables at this rank's *global* positions, so that a
  token is rotated by where it sits in the sequence, not in the slice.

Load balancing: under the causal mask, the rank holding the end of the sequence attends
to everything and the one holding the start to almost nothing, and the ring runs at the
pace of the slowest. Cut the sequence into 2W chunks and give rank r chunks r and
2W-1-r (an early one and a late one): every rank then has the same work at every step.
"""
from __future__ import annotations

import argparse

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.errors import UserError
from common.model import ModelConfig, Transformer


def add_cp_flags(p: argparse.ArgumentParser) -> None:
    """train_cp.py's own flags: the ring's load balancing, the data-parallel groups, FSDP."""
    p.set_defaults(doc_mask_refused=CP_DOC_MASK)  # --doc-mask (common/cli.py's add_saver_flags) is refused
    p.add_argument("--load-balance", action=argparse.BooleanOptionalAction, default=True,
                   help="give each rank an early and a late chunk of the sequence, so that the causal mask "
                        "leaves every rank the same work (default: on)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel groups: the batch is split over dp groups, each sharing its sequences over "
                        "world/dp ranks (default: 1)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and AdamW state over every rank with FSDP (torchtitan's layout) "
                        "instead of keeping them whole on each")


# --doc-mask's refusal ("--doc-mask cannot be used with ...; drop --doc-mask."): common/cli.py says it
CP_DOC_MASK = ("context parallelism (train_cp.py): its ring attention splits each sequence over the ranks and "
               "computes causal attention only, with no per-document mask")


def refuse_cp_compile(args: argparse.Namespace) -> None:
    """--compile around the hand-written ring is not offered (refused before any work)."""
    if args.compile:
        raise UserError("--compile is not offered with context parallelism: the hand-written ring sends and "
                        "receives inside every block's attention, and compiling around that is not tested here; "
                        "drop --compile.")


def cp_title(args: argparse.Namespace, cp: int) -> str:
    """train_cp.py's run title: the degree, the balancing, the data-parallel groups, FSDP."""
    return (f"Context parallel {cp}" + (" (load-balanced)" if args.load_balance else "")
            + (f" x {args.dp} data-parallel groups" if args.dp > 1 else "") + (", FSDP" if args.fsdp else ""))


def check_cp(cfg: ModelConfig, cp: int, seq_len: int, load_balance: bool, ac: str = "none"):
    """Refuse a sequence that does not split into equal slices, and selective activation
    checkpointing (before any collective)."""
    if ac.startswith("selective"):
        raise UserError(f"--ac {ac} is not offered with context parallelism: a selective policy keeps "
                        "matmuls' outputs, and inside the ring's attention those are each step's (seq/cp)^2 scores; "
                        "use --ac full.")
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks:
        how = (f"2 x the context-parallel degree {cp} (load balancing gives each rank two chunks)" if load_balance
               else f"the context-parallel degree {cp}")
        raise UserError(f"--seq-len {seq_len} does not split into {chunks} equal chunks; use a multiple of {how}.")


def positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` holds, in the order it holds them."""
    if not load_balance:
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    n = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange(late * n, (late + 1) * n)])


class Ring:
    """The cp group, as the ring attention needs it: who I am, who is next and previous."""

    def __init__(self, group, load_balance: bool):
        self.group, self.load_balance = group, load_balance
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        # The positions, copied once to the device they are used on (a few integers each):
        # copied at every use, each copy from pageable host memory would make the host wait
        # for the GPU, in every layer and ring step, forward and backward.
        self._on_device: dict = {}

    def positions(self, local_len: int, rank: int, device=None) -> torch.Tensor:
        if device is None:
            return positions(local_len * self.size, self.size, rank, self.load_balance)
        key = (local_len, rank, str(device))
        if key not in self._on_device:
            self._on_device[key] = self.positions(local_len, rank).to(device)
        return self._on_device[key]

    def start_pass(self, t: torch.Tensor):
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer,
        without waiting: returns (buffer, requests). Wait on the requests before reading it."""
        buf = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group),
                                       dist.P2POp(dist.irecv, buf, self.prev, self.group)])
        return buf, reqs


def _wait(reqs):
    for r in reqs:
        r.wait()


def _visible(ring: Ring, sq: int, src: int, groups: int, device) -> torch.Tensor | None:
    """The causal mask between my queries and rank ``src``'s keys, tiled for the grouped
    query heads: (groups x sq, sk) booleans; None when no query sees any key (skip it)."""
    # a rank's positions rise: some query sees some key iff src's first key is not after my
    # last query (decided from the layout, not by reading the mask: no wait for the device,
    # and a fake tensor's trace can take the same branch)
    if _first_last(ring, sq, src)[0] > _first_last(ring, sq, ring.rank)[1]:
        return None
    # built on the device from the positions already there (the mask itself is not kept: at
    # a long sequence it is large, and the memory figures would count it)
    q_pos, k_pos = ring.positions(sq, ring.rank, device), ring.positions(sq, src, device)
    return (k_pos[None, :] <= q_pos[:, None]).repeat(groups, 1)


def _first_last(ring: Ring, local_len: int, rank: int) -> tuple[int, int]:
    """The first and last global positions rank ``rank`` holds (``positions``, in Python)."""
    if not ring.load_balance:
        return rank * local_len, (rank + 1) * local_len - 1
    n = local_len // 2
    return rank * n, (2 * ring.size - rank) * n - 1


class _RingAttention(torch.autograd.Function):
    """Causal attention over a sequence spread over the ring, forward and backward.

    Shapes as SDPA takes them: q (B, Hq, S/W, D), k and v (B, Hkv, S/W, D) with Hq a
    multiple of Hkv (grouped-query attention). The arithmetic is done in fp32 whatever the
    input dtype; the output is returned in q's dtype.

    Queries are viewed as (B, Hkv, G x S/W, D), G = Hq / Hkv: the G query heads that share
    a key/value head become extra rows of one matmul, so grouped-query attention costs no
    copy of k or v, and the key/value gradients sum over those heads by the matmul itself.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        with torch.autocast(q.device.type, enabled=False):
            B, Hq, S, D = q.shape
            G, scale = Hq // k.shape[1], 1.0 / math.sqrt(D)
            qg = q.reshape(B, k.shape[1], G * S, D).float()
            kv = torch.stack([k, v])  # one message: the keys and values travel together
            out = lse = None
            for step in range(ring.size):
                if step < ring.size - 1:  # the next block is on its way while this one is used
                    incoming, reqs = ring.start_pass(kv)
                src = (ring.rank - step) % ring.size
                visible = _visible(ring, S, src, G, q.device)
                if visible is not None:  # a block wholly in my future is skipped
                    scores = (qg @ kv[0].float().transpose(-1, -2) * scale).masked_fill(~visible, -math.inf)
                    block_lse = scores.logsumexp(-1, keepdim=True)
                    # rows that see none of this block's keys: lse -inf, weight 0 (and no 0/0)
                    p = (scores - block_lse.masked_fill(block_lse == -math.inf, 0)).exp()
                    block_out = p @ kv[1].float()
                    if out is None:
                        out, lse = block_out, block_lse
                    else:  # online softmax: rescale both partial results to the common sum
                        new = torch.logaddexp(lse, block_lse)
                        out = out * (lse - new).exp() + block_out * (block_lse - new).exp()
                        lse = new
                if step < ring.size - 1:
                    _wait(reqs)
                    kv = incoming
            # laid out (B, S, H, D), as SDPA's CPU kernel returns it: the model's transpose and
            # reshape into wo's input are then a view, and one tensor serves both as saved
            out = out.view(B, Hq, S, D).transpose(1, 2).to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        with torch.autocast(q.device.type, enabled=False):
            B, Hq, S, D = q.shape
            Hkv = k.shape[1]
            G, scale = Hq // Hkv, 1.0 / math.sqrt(D)
            qg = q.reshape(B, Hkv, G * S, D).float()
            do = grad_out.reshape(B, Hkv, G * S, D).float()
            o = out.transpose(1, 2).reshape(B, Hkv, G * S, D).float()
            delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO * O): softmax's backward term
            dq = torch.zeros_like(qg)
            kv = torch.stack([k, v])
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with its block
            for step in range(ring.size):
                if step < ring.size - 1:
                    incoming, reqs = ring.start_pass(kv)
                src = (ring.rank - step) % ring.size
                visible = _visible(ring, S, src, G, q.device)
                if visible is not None:
                    kf, vf = kv[0].float(), kv[1].float()
                    # the probabilities, recomputed with the final lse: already normalised
                    p = ((qg @ kf.transpose(-1, -2) * scale).masked_fill(~visible, -math.inf) - lse).exp()
                    ds = p * (do @ vf.transpose(-1, -2) - delta)
                    dq += ds @ kf * scale
                    dkv[0] += ds.transpose(-1, -2) @ qg * scale
                    dkv[1] += p.transpose(-1, -2) @ do
                if step < ring.size - 1:
                    _wait(reqs)
                    kv = incoming
                if ring.size > 1:  # the gradient moves on with its block: after W hops it is home
                    dkv, reqs = ring.start_pass(dkv)
                    _wait(reqs)
        return dq.view_as(q).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q, k, v, is_causal: bool = True, enable_gqa: bool = False, *, ring: Ring):
    """SDPA's signature (causal only), over the ring."""
    assert is_causal, "the ring implements causal attention only"
    return _RingAttention.apply(q, k, v, ring)


def apply_cp(model: Transformer, cp_mesh, load_balance: bool = True) -> Transformer:
    """Context parallelism over ``cp_mesh``, in place: each block's attention kernel becomes
    the ring, and the rotary tables are read at this rank's global positions."""
    ring = Ring(cp_mesh.get_group(), load_balance)
    for block in model.layers.values():
        block.attention.sdpa = functools.partial(ring_attention, ring=ring)
    whole = model.rope_for

    def rope_for(h):  # h: (batch, this rank's tokens, dim)
        cos, sin = whole(h)
        mine = ring.positions(h.shape[1], ring.rank, cos.device)
        return cos[mine], sin[mine]

    model.rope_for = rope_for
    model.cp_ring = ring
    return model


def local_tokens(x: torch.Tensor, ring: Ring, device=None) -> torch.Tensor:
    """This rank's slice of a (batch, seq) batch: its columns, at its positions, on ``device``.

    The whole batch goes to the device first, then is sliced there: a CUDA run's batch is in
    pinned memory (common/data.py), and only a copy from pinned memory lets the host go on
    (``non_blocking``); a slice taken on the host would be a new, pageable tensor whose copy
    makes the host wait every step. The slice is the same tokens, wherever it is taken.
    """
    # CUDA path: tests/test_cp.py::test_the_pinned_batch_itself_is_copied_to_the_device_then_sliced
    x = x if device is None else x.to(device, non_blocking=True)
    return x[:, ring.positions(x.shape[1] // ring.size, ring.rank, x.device)]


def cp_degree(world: int, dp: int) -> int:
    """The ranks that share each sequence when ``dp`` groups split the batch."""
    if dp < 1 or world % dp:
        raise UserError(f"--dp {dp} does not divide the {world} ranks into equal context-parallel groups; use a "
                        f"divisor of {world}.")
    return world // dp


@torch.no_grad()
def cp_evaluate(model, tokens: torch.Tensor, args, device, ring: Ring) -> float | None:
    """training.evaluate, each rank on its slice of the held-out sequences: the mean of the
    ranks' mean losses (equal slices) is the mean over every token."""
    from common.data import Batches
    from common.training import eval_batch_count
    if args.eval_batches == 0 or len(tokens) <= args.seq_len * args.global_batch_size:
        return None
    model.eval()
    batches = iter(Batches(tokens, args.seq_len, args.global_batch_size, shuffle=False))
    total = torch.zeros((), device=device)
    n = eval_batch_count(tokens, args)
    for _ in range(n):
        x, y = (local_tokens(t, ring, device) for t in next(batches))
        total += F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    dist.all_reduce(total, group=ring.group)
    model.train()
    return total.item() / (n * ring.size)
