"""One training configuration (``Plan``): the model, the strategy and its degrees, the batch,
the savers. The formulas (common/measure/formulas.py), the splits (splits.py) and the
prediction (theory.py) all take one; so do the step-time model and the planner.

The strategy names a Plan accepts (``STRATEGIES``; ``ALIASES`` the other spellings) are here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.model import ModelConfig

DP_STRATEGIES = ("single", "ddp", "zero1", "fsdp_zero2", "fsdp_zero3", "hsdp", "hsdp_zero2")
STRATEGIES = DP_STRATEGIES + ("tp", "pp", "2d")
STRATEGIES += ("ep",)  # expert parallelism, the dense part FSDP (step3_multi_gpu/train_ep.py)
ALIASES = {"fsdp": "fsdp_zero3", "zero3": "fsdp_zero3", "zero2": "fsdp_zero2", "hsdp_zero3": "hsdp"}
STRATEGIES += ("cp", "cp_fsdp")  # context parallelism (common/parallelize/cp.py)


# ---- a whole configuration ---------------------------------------------------------------------
@dataclass
class Plan:
    """One training configuration: model, strategy, degrees, batch (global, in sequences)."""
    cfg: ModelConfig
    strategy: str = "single"
    world: int = 1
    tp: int = 1
    pp: int = 1
    shard: int | None = None          # HSDP's shard group size
    batch: int = 8
    seq_len: int = 256
    dtype: str = "fp32"
    ac: str = "none"
    ac_every: int = 1                 # checkpoint every k-th block (common/parallelize/ac.py:apply_ac)
    accum: int = 1
    microbatches: int | None = None   # pipeline micro-batches (default: pp)
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    loss_parallel: bool = True
    device: str = "cpu"               # whose kernels: "cpu" or "cuda" (attention's saved k/v)
    optimizer: str | None = None      # AdamW's kernels: foreach, fused or for-loop (None: the device's default)
    ep: int | None = None             # expert-parallel degree (strategy "ep"; default: the world size)
    notes: list = field(default_factory=list)
    cp: int | None = None             # context-parallel degree (strategies cp, cp_fsdp; default: the world size)
    loss_chunks: int = 1              # --loss-chunks: the output layer and the loss in chunks of tokens
    head_loss: bool | None = None     # the loss is the model's own (model(x, targets=y): train_ddp.py and
                                      # train_fsdp.py), holding no logits; None: from the strategy
    split_root: bool = False          # --split-root-unit: embedding and head in FSDP units of their own
    cpu_offload: bool = False         # --cpu-offload: FSDP's shards, gradients and AdamW state on the host

    def __post_init__(self):
        self.strategy = ALIASES.get(self.strategy, self.strategy)
        if self.dtype == "fp16":  # autocast to fp16 keeps the same 2-byte copies as bf16
            self.dtype = "bf16"
        if self.strategy == "tp" and self.tp == 1:
            self.tp = self.world
        if self.strategy == "pp" and self.pp == 1:
            self.pp = self.world
        if self.pp > 1 and self.tp > 1:  # train_3d.py's TP gives the last stage whole logits (no loss parallelism)
            self.loss_parallel = False
        if self.head_loss is None:
            self.head_loss = self.strategy in HEAD_LOSS_STRATEGIES
        if self.cpu_offload and not self.strategy.startswith(("fsdp", "hsdp")):
            raise ValueError(f"cpu_offload is FSDP's (train_fsdp.py --cpu-offload), not {self.strategy}'s")
        if self.optimizer is None:  # what torch.optim picks when told neither foreach nor fused
            # CUDA path: tests/test_estimate.py::test_where_the_1b_peaks_fall_and_what_is_device_specific
            self.optimizer = "foreach" if self.device == "cuda" else "for-loop"

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dp_kind(self) -> str:
        """How the data-parallel dimension treats the model state."""
        if self.strategy == "2d":  # 3-D (train_3d.py) keeps each stage gathered: ZeRO-2 (reshard_after_forward=False)
            return "fsdp_zero2" if self.pp > 1 else "fsdp_zero3"
        if self.strategy == "ep":  # experts split like FSDP's shards, but never gathered
            return "fsdp_zero3"
        if self.strategy in ("tp", "pp"):
            return "ddp" if self.dp > 1 else "single"
        if self.strategy == "fsdp_zero3" and self.pp > 1:  # FSDP with a pipeline: as train_3d.py keeps it
            return "fsdp_zero2"
        return self.strategy

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, dp index, tp index): tp varies fastest, then dp (train_2d's mesh)."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp


# the layouts whose scripts ask the model for the loss (model(x, targets=y)) instead of holding logits
HEAD_LOSS_STRATEGIES = ("ddp", "zero1", "fsdp_zero2", "fsdp_zero3", "hsdp", "hsdp_zero2")
