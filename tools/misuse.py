"""The misuse table: every way of holding the tutorial wrong that we know of, what the
learner then sees, and what to do. One list, three readers:

- tests/test_misuse.py runs every case and checks that it ends (within seconds), with a
  non-zero exit, the sentence below, naming the flag or file at fault, and no traceback;
- ``python -m tools.figures --only misuse`` writes it as the troubleshooting table of
  step4_multi_node/README.md (block ``misuse``), so the page cannot drift from what the
  scripts say;
- ``python -m tools.misuse`` runs the cases and prints what each one printed, to read.

It lives in tools/ because no training script imports it: the scripts hold the checks,
this file only lists them. Most cases fail while the flags are checked, so they run
in-process (``run_case``: the script's ``main()`` with that argv, as tools/multirun.py
does); the few that need several ranks run together in one torchrun job
(``torchrun --nproc-per-node 2 tools/misuse.py --worker NAME,NAME,... --json FILE``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

S1, S2, S3 = "step1_single_gpu/train.py", "step2_memory/", "step3_multi_gpu/"
# The smallest run that gets past every check: a 4-layer model, two steps, no figure.
T = ["--model", "debug", "--seq-len", "32", "--global-batch-size", "4", "--steps", "2", "--no-trace-memory",
     "--eval-batches", "0", "--device", "cpu", "--out", "{tmp}/out"]


@dataclass
class Case:
    did: str           # what was tried (markdown, for the table)
    argv: list         # script, then its flags; {tmp} is this case's own empty folder
    says: str          # a fragment of the one sentence it prints (the table's "what you see")
    names: str         # the flag or file the sentence must name
    fix: str           # what to do (the table's last column)
    ranks: int = 1     # 1: in-process, plain python; 2: in the shared torchrun job
    setup: str = ""    # a function of this module that prepares {tmp} first
    cpu_only: bool = False  # a misuse only where there is no GPU (--device cuda)


CASES: dict[str, Case] = {
    # ---- the shared flags (step 1 stands for every training script: one parser, cli.parse)
    "unknown model": Case("`--model huge`", [S1, *T, "--model", "huge"], "unknown --model 'huge'; choose one of",
                          "--model", "pick a preset from the list"),
    "zero steps": Case("`--steps 0`", [S1, *T, "--steps", "0"], "--steps must be positive (got 0)", "--steps",
                       "a positive number"),
    "seq too long": Case("`--seq-len 4096` with `--model debug`", [S1, *T, "--seq-len", "4096"],
                         "is longer than model 'debug' supports (256)", "--seq-len", "use the preset's length or less"),
    "negative lr": Case("`--lr -1`", [S1, *T, "--lr", "-1"], "--lr must be a positive number (got -1.0)", "--lr",
                        "a positive learning rate"),
    "nan lr": Case("`--lr nan`", [S1, *T, "--lr", "nan"], "--lr must be a positive number (got nan)", "--lr",
                   "a positive, finite learning rate"),
    "negative seed": Case("`--seed -1`", [S1, *T, "--seed", "-1"], "--seed must be between 0 and 2**63 - 1",
                          "--seed", "a seed in range"),
    "nan max-norm": Case("`--max-norm nan` (or `-1`)", [S1, *T, "--max-norm", "nan"],
                         "--max-norm must be 0 (no clipping) or a positive number", "--max-norm",
                         "0 to only measure the norm, else the clipping threshold"),
    "huge pg-timeout": Case("`--pg-timeout 1e300`", [S1, *T, "--pg-timeout", "1e300"],
                            "--pg-timeout 1e+300 is out of range: give between 1 and 2592000 seconds",
                            "--pg-timeout", "seconds between 1 and 30 days (default 600)"),
    "tiny pg-timeout": Case("`--pg-timeout 1e-9`", [S1, *T, "--pg-timeout", "1e-9"],
                            "--pg-timeout 1e-09 is out of range", "--pg-timeout",
                            "at least a second: ranks need that to start"),
    "nan pg-timeout": Case("`--pg-timeout nan` (or `0`)", [S1, *T, "--pg-timeout", "nan"],
                           "--pg-timeout must be positive seconds (got nan)", "--pg-timeout", "a number of seconds"),
    "negative ckpt-every": Case("`--ckpt-every -2`", [S1, *T, "--ckpt-every", "-2"],
                                "--ckpt-every cannot be negative (got -2); 0 turns checkpoints off", "--ckpt-every",
                                "0 (off) or every how many steps"),
    "zero ckpt-keep": Case("`--ckpt-keep 0`", [S1, *T, "--ckpt-keep", "0"], "--ckpt-keep must be at least 1 (got 0)",
                           "--ckpt-keep", "keep at least one"),
    "ckpt-async without ckpt-every": Case("`--ckpt-async` without `--ckpt-every`", [S1, *T, "--ckpt-async"],
                                          "--ckpt-async says how checkpoints are written, and --ckpt-every is 0",
                                          "--ckpt-every", "add --ckpt-every N"),
    "fail-how without a step": Case("`--fail-how sigterm` without `--fail-at-step`", [S1, *T, "--fail-how", "sigterm"],
                                    "--fail-how sigterm says what happens at --fail-at-step; give that step too",
                                    "--fail-at-step", "add --fail-at-step N"),
    "sigterm-torchrun without torchrun": Case(
        "`--fail-how sigterm-torchrun` under plain python", [S1, *T, "--fail-at-step", "0", "--fail-how",
                                                             "sigterm-torchrun"],
        "signals the torchrun that started this run, and there is none", "--fail-how",
        "launch with torchrun, or --fail-how sigterm"),
    "chaos without a script": Case("`tools/chaos.py --script nope.py`", ["tools/chaos.py", "--script", "nope.py"],
                                   "--script nope.py is not a file of this repository", "nope.py",
                                   "a training script's path, from the repository's top"),
    "fail-at-step past end": Case("`--fail-at-step 2 --steps 2`", [S1, *T, "--fail-at-step", "2"],
                                  "--fail-at-step 2 is not a step of this run (0 to 1)", "--fail-at-step",
                                  "a step of the run"),
    "fail-rank missing": Case("`--fail-rank 1` on one rank", [S1, *T, "--fail-at-step", "0", "--fail-rank", "1"],
                              "--fail-rank 1 does not exist: this run has ranks 0 to 0", "--fail-rank",
                              "a rank of the run"),
    "abbreviated flag": Case("`--step 3` (a prefix of `--steps`)", [S1, *T, "--step", "3"],
                             "unrecognized arguments: --step 3 (--help lists the flags)", "--step",
                             "spell the flag out: no parser accepts prefixes"),
    "bad choice": Case("`--on-nan ignore`", [S1, *T, "--on-nan", "ignore"],
                       "argument --on-nan: invalid choice: 'ignore'", "--on-nan", "one of the listed choices"),
    "missing data": Case("`--data /no/such/place`", [S1, *T, "--data", "/no/such/place"], "no such file or folder",
                         "/no/such/place", "a text file, a folder of them, 'stdlib' or 'synthetic'"),
    "out is a file": Case("`--out notes.txt`, an existing file", [S1, *T, "--out", "{tmp}/notes.txt"],
                          "is a file, not a folder; give a folder", "notes.txt", "a folder (it is created if missing)",
                          setup="make_file"),
    "out unwritable": Case("`--out` where nothing can be written", [S1, *T, "--out", "/proc/misuse_out"],
                           "cannot be written", "/proc/misuse_out", "a folder you can write to"),
    "huge model": Case("`--n-layers 1000000`", [S1, *T, "--n-layers", "1000000"],
                       "their weights, gradients and AdamW state alone need", "--n-layers",
                       "fewer layers or a smaller preset"),
    "zero layers": Case("`--n-layers 0`", [S1, *T, "--n-layers", "0"], "--n-layers must be positive (got 0)",
                        "--n-layers", "a positive number of layers"),
    "vocab on text": Case("`--vocab-size 128256` on the stdlib text", [S1, *T, "--vocab-size", "128256"],
                          "--vocab-size 128256 needs --data synthetic", "--vocab-size",
                          "add --data synthetic (random token ids), or keep the byte vocabulary for real text"),
    "trace past end": Case("`--trace-start 5 --steps 2`", [S1, *T, "--trace-memory", "--trace-start", "5"],
                           "--trace-start 5 is past the last step (1)", "--trace-start",
                           "an earlier step, more steps, or --no-trace-memory"),
    "negative eval-every": Case("`--eval-every -1`", [S1, *T, "--eval-every", "-1"],
                                "--eval-every cannot be negative (got -1)", "--eval-every",
                                "0 (the validation loss at the end only) or every how many steps"),
    "eval-every without batches": Case("`--eval-every 2 --eval-batches 0`", [S1, *T, "--eval-every", "2"],
                                       "--eval-every 2 has nothing to measure with --eval-batches 0", "--eval-batches",
                                       "--eval-batches 1 or more, or drop --eval-every"),
    "no such device": Case("`--device tpu`", [S1, *T, "--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda",
                           "--device", "auto, cpu or cuda"),
    "cuda without gpu": Case("`--device cuda` without a GPU", [S1, *T, "--device", "cuda"],
                             "--device cuda was asked for but no CUDA GPU is visible", "--device",
                             "--device cpu", cpu_only=True),
    # ---- checkpoints and --out shared between runs
    "another run's checkpoint": Case(
        "`--resume` with other flags than the checkpoint's run (here `--lr`, `--seed`)",
        [S1, *T, "--steps", "4", "--resume", "--lr", "0.001", "--seed", "1"],
        "holds a checkpoint of another run (step_00000001): --lr 0.003 there, 0.001 here; --seed 0 there, 1 here",
        "--lr", "the same flags, another --out, or delete its checkpoints", setup="checkpoint"),
    # (a finished run there is moved aside instead: common/run_folder.py:keep_finished_run)
    "beside another run's checkpoint": Case(
        "`--ckpt-every` into an `--out` holding an unfinished run's checkpoints", [S1, *T, "--ckpt-every", "1",
                                                                                "--global-batch-size", "8"],
        "holds a checkpoint of another run (step_00000001): --global-batch-size 4 there, 8 here", "--global-batch-size",
        "the same flags with --resume, another --out, or delete its checkpoints", setup="unfinished"),
    "finished run": Case("`--resume` of a run that is done", [S1, *T, "--resume"],
                         "is at step 1, the last of --steps 2 or past it: nothing is left to train", "--steps",
                         "raise --steps to continue", setup="checkpoint"),
    "corrupt meta.json": Case("`--resume` from a checkpoint whose `meta.json` is not JSON", [S1, *T, "--steps", "4",
                                                                                            "--resume"],
                              "meta.json cannot be read (JSONDecodeError)", "step_00000001",
                              "move that checkpoint aside: the one before it is used", setup="bad_meta"),
    "truncated checkpoint": Case("`--resume` from a truncated `.distcp` file (a full disk)",
                                 [S1, *T, "--steps", "4", "--resume"], "cannot be read", "step_00000001",
                                 "move it aside to resume from the one before it", setup="truncated"),
    "checkpoint unwritable": Case("a checkpoint that cannot be written (`<out>/checkpoints` is not a folder; a full "
                                  "disk says the same)", [S1, *T, "--ckpt-every", "1"],
                                  "the checkpoint of step 0 could not be written to", "checkpoints",
                                  "free space or make the folder writable, then --resume", setup="ckpt_file"),
    "live run in out": Case("a second run into the `--out` of a live one", [S1, *T],
                            "is writing into --out", "--out", "wait for it, or use another --out", setup="live_lock"),
    # ---- chapter 2
    "unknown amp": Case("`train_amp.py --amp fp8`", [S2 + "train_amp.py", *T, "--amp", "fp8"],
                        "unknown --amp 'fp8'; choose one of", "--amp", "bf16, fp16 or off"),
    "unknown ac": Case("`train_amp_ac.py --ac sometimes`", [S2 + "train_amp_ac.py", *T, "--ac", "sometimes"],
                       "unknown --ac mode 'sometimes'", "--ac", "none, full, selective or selective-op"),
    "zero ac-every": Case("`train_amp_ac.py --ac-every 0`", [S2 + "train_amp_ac.py", *T, "--ac-every", "0"],
                          "--ac-every must be positive (got 0)", "--ac-every", "checkpoint every k-th block, k >= 1"),
    "uneven accum": Case("`train_accum.py --grad-accum 3` with a batch of 4",
                         [S2 + "train_accum.py", *T, "--grad-accum", "3"],
                         "--grad-accum 3 does not split --global-batch-size 4 into equal micro-batches",
                         "--grad-accum", "a divisor of the batch"),
    "zero accum": Case("`train_accum.py --grad-accum 0`", [S2 + "train_accum.py", *T, "--grad-accum", "0"],
                       "--grad-accum must be positive (got 0)", "--grad-accum", "a positive number"),
    "bench batch": Case("`bench_memory_savers.py --global-batch-size 6`",
                        [S2 + "bench_memory_savers.py", *T, "--global-batch-size", "6"],
                        "the accumulation set-ups split the batch in 4", "--global-batch-size",
                        "a multiple of 4"),
    "bench threads": Case("`bench_memory_savers.py --threads 0`", [S2 + "bench_memory_savers.py", *T, "--threads",
                                                                   "0"],
                          "--threads must be at least 1 (got 0)", "--threads", "1 or more"),
    "bench tensorboard": Case("`bench_memory_savers.py --tensorboard`", [S2 + "bench_memory_savers.py", *T,
                                                                           "--tensorboard"],
                              "does not take --tensorboard (it compares or times runs of its own)", "--tensorboard",
                              "--tensorboard with a training script"),
    # ---- chapter 3, one rank (plain python)
    "powersgd rank": Case("`train_ddp.py --comm-hook powersgd --powersgd-rank 0`",
                          [S3 + "train_ddp.py", *T, "--comm-hook", "powersgd", "--powersgd-rank", "0"],
                          "--powersgd-rank must be at least 1 (got 0)", "--powersgd-rank", "a rank of 1 or more"),
    "unknown hook": Case("`train_ddp.py --comm-hook zip`", [S3 + "train_ddp.py", *T, "--comm-hook", "zip"],
                         "argument --comm-hook: invalid choice: 'zip'", "--comm-hook", "none, fp16, bf16 or powersgd"),
    "hsdp mesh": Case("`train_fsdp.py --hsdp 2 2` on the wrong number of ranks",
                      [S3 + "train_fsdp.py", *T, "--hsdp", "2", "2"],
                      "a 2 x 2 mesh (replicate, shard) needs 4 ranks but 1 were launched", "replicate, shard",
                      "make replicas x shards equal the ranks launched"),
    "hsdp one number": Case("`train_fsdp.py --hsdp 2`", [S3 + "train_fsdp.py", *T, "--hsdp", "2"],
                            "argument --hsdp: expected 2 arguments", "--hsdp", "two numbers: replicas and shards"),
    "unknown schedule": Case("`train_pp.py --schedule zigzag`", [S3 + "train_pp.py", *T, "--schedule", "zigzag"],
                             "--schedule 'zigzag': choose one of", "--schedule", "a schedule from the list"),
    "zero microbatches": Case("`train_pp.py --microbatches 0`", [S3 + "train_pp.py", *T, "--microbatches", "0"],
                              "--microbatches must be positive (got 0)", "--microbatches", "1 or more"),
    "2d negative tp": Case("`train_2d.py --tp -2`", [S3 + "train_2d.py", *T, "--tp", "-2"],
                           "--dp and --tp must be positive", "--tp", "positive degrees"),
    "3d mesh": Case("`train_3d.py --pp 2 --dp 1 --tp 1` on one rank", [S3 + "train_3d.py", *T, "--pp", "2", "--dp",
                                                                      "1", "--tp", "1"],
                    "a 2 x 1 x 1 mesh (pp, dp, tp) needs 2 ranks but 1 were launched", "pp, dp, tp",
                    "make pp x dp x tp equal the ranks launched"),
    "hooks alone": Case("`compare_comm_hooks.py` under plain python", [S3 + "compare_comm_hooks.py", *T],
                        "needs at least 2 ranks; launch it with torchrun", "compare_comm_hooks.py",
                        "torchrun --nproc-per-node 2 or more"),
    "unknown hooks": Case("`compare_comm_hooks.py --comm-hooks fp16,zip`",
                          [S3 + "compare_comm_hooks.py", *T, "--comm-hooks", "fp16,zip"],
                          "argument --comm-hooks: 'fp16,zip': give a comma-separated list", "--comm-hooks",
                          "hooks from none, fp16, bf16, powersgd"),
    "bench budget": Case("`bench_collectives.py --budget nan`", [S3 + "bench_collectives.py", "--device", "cpu",
                                                                "--budget", "nan"],
                         "--budget between 0 and 3600 seconds (got nan)", "--budget", "seconds per timed block"),
    "bench ops": Case("`bench_collectives.py --ops scatter`", [S3 + "bench_collectives.py", "--device", "cpu", "--ops",
                                                               "scatter"],
                      "--ops 'scatter': choose from", "--ops", "collectives from the list"),
    "bench max-size": Case("`bench_collectives.py --max-size 1000000000000000`",
                           [S3 + "bench_collectives.py", "--device", "cpu", "--max-size", "1000000000000000"],
                           "do not fit in this machine's", "--max-size", "a size that fits (it says the most)"),
    "bench alone": Case("`bench_collectives.py` under plain python", [S3 + "bench_collectives.py", "--device", "cpu",
                                                                      "--out", "{tmp}/out"],
                        "needs at least 2 ranks; launch it with torchrun", "bench_collectives.py",
                        "torchrun --nproc-per-node 2 or more"),
    "ring iters": Case("`ring_allreduce.py --iters 0`", [S3 + "ring_allreduce.py", "--device", "cpu", "--iters", "0"],
                       "--iters must be positive", "--iters", "1 or more"),
    "ring max-size": Case("`ring_allreduce.py --max-size 1000000000000000`",
                          [S3 + "ring_allreduce.py", "--device", "cpu", "--max-size", "1000000000000000"],
                          "do not fit in this machine's", "--max-size", "a size that fits (it says the most)"),
    "dp gpus": Case("`dp_vs_ddp.py --gpus 1`", [S3 + "dp_vs_ddp.py", *T, "--gpus", "1"],
                    "--gpus 1: the comparison needs at least 2 GPUs", "--gpus", "2 or more GPUs"),
    "ddp zero accum": Case("`train_ddp.py --grad-accum 0`", [S3 + "train_ddp.py", *T, "--grad-accum", "0"],
                           "--grad-accum must be positive (got 0)", "--grad-accum", "a positive number"),
    "pp uneven microbatches": Case("`train_pp.py --microbatches 3` with a batch of 4",
                                   [S3 + "train_pp.py", *T, "--microbatches", "3"],
                                   "--global-batch-size 4 does not split into 3 equal micro-batches",
                                   "--global-batch-size", "a batch that is a multiple of the micro-batches"),
    "dualpipev too few": Case("`train_pp.py --schedule dualpipev --microbatches 1` on 1 rank (2 stages)",
                              [S3 + "train_pp.py", *T, "--schedule", "dualpipev", "--microbatches", "1"],
                              "dualpipev needs at least as many micro-batches as its 2 stages", "--microbatches",
                              "at least two per rank"),
    "zbv compile": Case("`train_pp.py --schedule zbv --compile`", [S3 + "train_pp.py", *T, "--schedule", "zbv",
                                                                 "--compile"],
                        "--compile with --schedule zbv: the schedule splits each backward", "--compile",
                        "no --compile with zbv or dualpipev"),
    "zbv selective ac": Case("`train_pp.py --schedule dualpipev --ac selective`",
                             [S3 + "train_pp.py", *T, "--schedule", "dualpipev", "--microbatches", "4", "--ac",
                              "selective"],
                             "--ac selective with --schedule dualpipev: selective checkpointing lets each region",
                             "--ac", "--ac full with zbv or dualpipev"),
    "batch beyond the data": Case("`--global-batch-size 100000000`", [S1, *T, "--global-batch-size", "100000000"],
                                  "fewer than one global batch of 100000000", "--global-batch-size",
                                  "more text, a shorter --seq-len or a smaller batch"),
    # ---- dry runs of context and expert parallelism: one rank alone, checked before it trains
    "cp dry run sequence": Case("`train_cp.py --fake-world-size 8 --seq-len 40`",
                                [S3 + "train_cp.py", *T, "--fake-world-size", "8", "--seq-len", "40"],
                                "--seq-len 40 does not split into 16 equal chunks", "--seq-len",
                                "a multiple of 2 x the CP degree"),
    "ep dry run experts": Case("`train_ep.py --model debug-moe --fake-world-size 3` (8 experts)",
                               [S3 + "train_ep.py", *T, "--model", "debug-moe", "--fake-world-size", "3"],
                               "the model's 8 experts do not split evenly over 3 expert-parallel ranks",
                               "--fake-world-size", "a world size that divides the experts"),
    "ep dry run degree": Case("`train_ep.py --model debug-moe --fake-world-size 4 --ep 3`",
                              [S3 + "train_ep.py", *T, "--model", "debug-moe", "--fake-world-size", "4", "--ep", "3"],
                              "--ep 3 does not divide the 4 ranks into groups", "--ep",
                              "a divisor of the world size"),
    # ---- chapter 3, two ranks (one torchrun job)
    "tp sequence split": Case("`train_tp.py --sequence-parallel --seq-len 33` on 2 ranks",
                              [S3 + "train_tp.py", *T, "--sequence-parallel", "--seq-len", "33"],
                              "--seq-len 33 is not divisible by the tensor-parallel degree 2", "--seq-len",
                              "a multiple of the degree", ranks=2),
    "1f1b too few": Case("`train_pp.py --microbatches 1` on 2 stages", [S3 + "train_pp.py", *T, "--microbatches", "1"],
                         "1f1b needs at least as many micro-batches as pipeline ranks", "--microbatches",
                         "at least one per stage", ranks=2),
    "fsdp hsdp 1x3": Case("`train_fsdp.py --hsdp 1 3` on 2 ranks", [S3 + "train_fsdp.py", *T, "--hsdp", "1", "3"],
                          "a 1 x 3 mesh (replicate, shard) needs 3 ranks but 2 were launched", "replicate, shard",
                          "replicas x shards = ranks", ranks=2),
    "fail-rank of two": Case("`train_ddp.py --fail-at-step 0 --fail-rank 2` on 2 ranks",
                             [S3 + "train_ddp.py", *T, "--fail-at-step", "0", "--fail-rank", "2"],
                             "--fail-rank 2 does not exist: this run has ranks 0 to 1", "--fail-rank",
                             "a rank of the run", ranks=2),
    "powersgd start": Case("`compare_comm_hooks.py --comm-hooks powersgd --powersgd-start-iter 1`",
                           [S3 + "compare_comm_hooks.py", *T, "--comm-hooks", "powersgd", "--powersgd-start-iter",
                            "1"],
                           "--powersgd-start-iter must be at least 2 (got 1)", "--powersgd-start-iter",
                           "2 or more: DDP rebuilds its buckets after step 1", ranks=2),
    # ---- chapter 4: the two-node rehearsal on one machine (a shell script: bash runs it)
    "two nodes on gpus": Case("`two_nodes_on_one_machine.sh ... --device cuda`",
                              ["step4_multi_node/two_nodes_on_one_machine.sh", S3 + "train_ddp.py", "--model", "debug",
                               "--device", "cuda"],
                              "would share this machine's GPUs, and NCCL refuses two ranks on one GPU", "--device cuda",
                              "leave `--device` out: the rehearsal runs on the CPU"),
    # ---- tools
    "estimate hsdp": Case("`tools/estimate.py --strategy hsdp --hsdp-shard 3 --world-size 4`",
                          ["tools/estimate.py", "--strategy", "hsdp", "--hsdp-shard", "3", "--world-size", "4"],
                          "a 1 x 3 mesh (replicate, shard) needs 3 ranks but 4 are in --world-size", "--world-size",
                          "a shard group size that divides the world"),
    "estimate fsdp degrees": Case("`tools/estimate.py --strategy fsdp --pp 2 --world-size 4`",
                                  ["tools/estimate.py", "--strategy", "fsdp", "--pp", "2", "--world-size", "4",
                                   "--model", "debug", "--seq-len", "64"],
                                  "with --pp 2: no script runs that layout", "--strategy",
                                  "--strategy 2d: FSDP with TP or a pipeline (train_2d.py, train_3d.py)"),
    "estimate stages": Case("`tools/estimate.py --strategy pp --world-size 8 --model debug` (4 layers)",
                            ["tools/estimate.py", "--strategy", "pp", "--world-size", "8", "--model", "debug",
                             "--seq-len", "64"],
                            "8 pipeline stages (8 ranks x 1 with 1f1b) but the model has only 4 layers",
                            "--n-layers", "fewer stages or more layers"),
    "estimate tp": Case("`tools/estimate.py --strategy tp --world-size 3 --model debug`",
                        ["tools/estimate.py", "--strategy", "tp", "--world-size", "3", "--model", "debug",
                         "--seq-len", "64"],
                        "is not divisible by the tensor-parallel degree 3", "n_heads",
                        "a degree that divides the heads"),
    "estimate zero": Case("`tools/estimate.py --n-layers 0` (or `--hsdp-shard 0`, `--microbatches 0`)",
                          ["tools/estimate.py", "--n-layers", "0"], "--n-layers must be positive (got 0)",
                          "--n-layers", "positive numbers: 0 is not 'the default'"),
    "estimate gpu-mem": Case("`tools/estimate.py --gpu-mem nan`", ["tools/estimate.py", "--gpu-mem", "nan"],
                             "--gpu-mem must be a positive number of GiB (got nan)", "--gpu-mem",
                             "the GiB one GPU reports"),
    "plan gpu": Case("`tools/plan.py --gpu v100`", ["tools/plan.py", "--gpu", "v100"],
                     "unknown --gpu 'v100'; choose one of h100, h200, a100", "--gpu",
                     "a described GPU, or measure yours with --calibrate"),
    "plan nodes": Case("`tools/plan.py --gpus 12 --gpus-per-node 8`",
                       ["tools/plan.py", "--gpus", "12", "--gpus-per-node", "8"],
                       "--gpus 12 does not fill whole nodes of --gpus-per-node 8", "--gpus-per-node",
                       "a multiple of the node's GPUs"),
    "plan batch": Case("`tools/plan.py --gpus 8 --global-batch-size 1 --model debug --seq-len 63`",
                       ["tools/plan.py", "--gpus", "8", "--global-batch-size", "1", "--model", "debug", "--seq-len",
                        "63"], "no step-3 script runs any layout of --gpus 8 with --global-batch-size 1",
                       "--global-batch-size", "at least one sequence per data-parallel rank"),
    "plan calibration": Case("`tools/plan.py --calibration` of a file that is not there",
                             ["tools/plan.py", "--calibration", "{tmp}/calibration.json"],
                             "no such file; make it with python -m tools.plan --calibrate", "--calibration",
                             "run --calibrate first"),
    "compare corrupt": Case("`tools/compare.py` of a run whose `summary.json` is damaged",
                            ["tools/compare.py", "{tmp}/run", "--out", "{tmp}/cmp"],
                            "summary.json cannot be read (JSONDecodeError", "summary.json",
                            "rerun that run, or leave its folder out", setup="bad_summary"),
    "compare missing": Case("`tools/compare.py runs/nothing`", ["tools/compare.py", "{tmp}/nothing", "--out",
                                                                "{tmp}/cmp"],
                            "does not exist; pass the --out folder of a finished run", "nothing",
                            "the --out folder of a finished run"),
    "multirun json": Case("`tools/multirun.py --runs nope`", ["tools/multirun.py", "--runs", "nope"],
                          "--runs is not JSON", "--runs", "a JSON list of {name, script, argv}"),
    "multirun script": Case("`tools/multirun.py` with a script that is not there",
                            ["tools/multirun.py", "--runs", '[{"name": "a", "script": "nope.py", "argv": []}]'],
                            "script 'nope.py' is not a file of this repository", "nope.py",
                            "a script path relative to the repository"),
    "bench_model batch": Case("`tools/bench_model.py --batch 0`", ["tools/bench_model.py", "--batch", "0"],
                              "--batch must be positive and --seq-len between 1 and 2048", "--batch",
                              "a positive batch, a length the preset supports"),
    "gpu_check timeout": Case("`tools/gpu_check.py --timeout nan`", ["tools/gpu_check.py", "--timeout", "nan"],
                              "--timeout must be between 1 and 86400 seconds (got nan)", "--timeout",
                              "seconds per launch"),
    "bubble counts": Case("`tools/pipeline_bubble.py --microbatches 1,x`",
                          ["tools/pipeline_bubble.py", "--microbatches", "1,x"],
                          "--microbatches '1,x': give comma-separated positive whole numbers", "--microbatches",
                          "counts like 1,2,4,8"),
    "bubble schedule": Case("`tools/pipeline_bubble.py --schedules zb`", ["tools/pipeline_bubble.py", "--schedules",
                                                                         "zb"],
                            "--schedules 'zb': give a comma-separated list of gpipe, 1f1b", "--schedules",
                            "schedules train_pp.py knows"),
    # ---- context parallelism (step3_multi_gpu/train_cp.py, tools/estimate.py --strategy cp)
    "cp seq split": Case("`train_cp.py --seq-len 33`", [S3 + "train_cp.py", *T, "--seq-len", "33"],
                         "--seq-len 33 does not split into 2 equal chunks; use a multiple of 2 x the context-parallel "
                         "degree 1", "--seq-len", "a multiple of 2 x the ranks (of the ranks with --no-load-balance)"),
    "cp compile": Case("`train_cp.py --compile`", [S3 + "train_cp.py", *T, "--compile"],
                       "--compile is not offered with context parallelism", "--compile", "train without it"),
    "cp selective ac": Case("`train_cp.py --ac selective`", [S3 + "train_cp.py", *T, "--ac", "selective"],
                            "--ac selective is not offered with context parallelism", "--ac", "--ac full"),
    "cp dp": Case("`train_cp.py --dp 2` on one rank", [S3 + "train_cp.py", *T, "--dp", "2"],
                  "--dp 2 does not divide the 1 ranks into equal context-parallel groups", "--dp",
                  "a divisor of the ranks"),
    "estimate cp degree": Case("`tools/estimate.py --strategy cp --world-size 8 --cp 3`",
                               ["tools/estimate.py", "--strategy", "cp", "--world-size", "8", "--cp", "3"],
                               "--cp 3 does not divide --world-size 8 into data-parallel groups", "--cp",
                               "a divisor of the world size"),
    "estimate cp seq": Case("`tools/estimate.py --strategy cp --world-size 4 --seq-len 2044`",
                            ["tools/estimate.py", "--strategy", "cp", "--world-size", "4", "--seq-len", "2044"],
                            "--seq-len 2044 does not split into 8 equal chunks", "--seq-len",
                            "a multiple of 2 x the CP degree"),
    "estimate cp tp": Case("`tools/estimate.py --strategy cp --world-size 4 --tp 2`",
                           ["tools/estimate.py", "--strategy", "cp", "--world-size", "4", "--tp", "2"],
                           "train_cp.py splits the ranks into data-parallel groups of context-parallel ranks, "
                           "nothing else; drop --tp and --pp",
                           "--tp", "CP over every rank, nothing else"),
    # ---- mixtures of experts and expert parallelism (step3_multi_gpu/expert_parallel.md)
    "moe under tp": Case("`train_tp.py --model debug-moe` (any script but step 1 and train_ep.py)",
                         [S3 + "train_tp.py", *T, "--model", "debug-moe"],
                         "is a mixture of experts, which train_tp.py cannot train", "--model",
                         "step1_single_gpu/train.py or train_ep.py"),
    "ep dense model": Case("`train_ep.py --model debug`", [S3 + "train_ep.py", *T, "--model", "debug"],
                           "--model debug has no experts to spread over the ranks", "--model",
                           "a -moe preset"),
    "ep experts split": Case("`tools/estimate.py --strategy ep --world-size 3 --model debug-moe` (train_ep.py on "
                             "3 ranks says the same)",
                             ["tools/estimate.py", "--strategy", "ep", "--world-size", "3", "--model", "debug-moe",
                              "--seq-len", "64"],
                             "the model's 8 experts do not split evenly over 3 expert-parallel ranks", "experts",
                             "a number of ranks that divides n_experts"),
    "ep degree": Case("`tools/estimate.py --strategy ep --world-size 4 --ep 3 --model debug-moe` (train_ep.py "
                      "`--ep 3` on 4 ranks says the same)",
                      ["tools/estimate.py", "--strategy", "ep", "--world-size", "4", "--ep", "3", "--model", "debug-moe",
                       "--seq-len", "64"],
                      "--ep 3 does not divide the 4 ranks into groups that each hold every expert", "--ep",
                      "a divisor of the number of ranks"),
    "n-experts below top_k": Case("`train.py --model debug-moe --n-experts 1`",
                                  [S1, *T, "--model", "debug-moe", "--n-experts", "1"],
                                  "--n-experts 1 is fewer than the 2 experts each token goes to", "--n-experts",
                                  "at least top_k experts"),
    "negative aux weight": Case("`train.py --model debug-moe --aux-loss-weight -1`",
                                [S1, *T, "--model", "debug-moe", "--aux-loss-weight", "-1"],
                                "--aux-loss-weight must be 0 or a positive number (got -1.0)", "--aux-loss-weight",
                                "0 (no balancing) or a small weight such as 0.01"),
    # ---- float8 (step 2.6) and DeepSpeed beside our ZeRO
    "float8 fp16": Case("`train_float8.py --amp fp16`", [S2 + "train_float8.py", *T, "--amp", "fp16"],
                        "--amp fp16 is not offered with float8", "--amp", "--amp bf16, the default"),
    "float8 fsdp gloo": Case("`train_fsdp.py --float8` on gloo (CPU)", [S3 + "train_fsdp.py", *T, "--float8"],
                             "--float8 all-gathers float8 weights, which gloo cannot send (NCCL only)", "--float8",
                             "NCCL GPUs, or step2_memory/train_float8.py on one device"),
    "deepspeed checkpoint": Case("`train_deepspeed.py --ckpt-every 1`",
                                 [S3 + "train_deepspeed.py", *T, "--ckpt-every", "1"],
                                 "train_deepspeed.py does not checkpoint", "--ckpt-every",
                                 "DeepSpeed's engine.save_checkpoint; drop the flag"),
    "deepspeed compare one rank": Case("`tools/deepspeed_compare.py --nproc 1`",
                                       ["tools/deepspeed_compare.py", "--nproc", "1"],
                                       "--nproc must be at least 2: one rank has nothing to shard", "--nproc",
                                       "2 ranks or more"),
    # ---- using what was trained (python -m tools.generate, python -m tools.export_hf)
    "generate no weights": Case("`python -m tools.generate` on a run folder that saved no weights",
                                ["tools/generate.py", "{tmp}", "--device", "cpu"],
                                "holds no weights: train with --save-weights (OUT/weights.pt) or --ckpt-every N",
                                "--save-weights", "train with `--save-weights` or `--ckpt-every`, give that `--out`"),
    "generate long prompt": Case("`python -m tools.generate --prompt` longer than the run's `--seq-len`",
                                 ["tools/generate.py", "{tmp}/out", "--prompt", "x" * 40, "--device", "cpu"],
                                 "--prompt is 40 bytes, longer than the 32 positions the model was trained on",
                                 "--prompt", "a prompt of at most the run's `--seq-len` bytes", setup="checkpoint"),
    "generate temperature": Case("`python -m tools.generate --temperature -1`",
                                 ["tools/generate.py", "{tmp}", "--temperature", "-1"],
                                 "--temperature must be 0 (greedy) or a positive number (got -1.0)", "--temperature",
                                 "0 for the most likely byte, else a positive temperature"),
    "export moe": Case("`python -m tools.export_hf` on a mixture-of-experts run",
                       ["tools/export_hf.py", "{tmp}/moe", "--out", "{tmp}/hf"],
                       "this model is a mixture of experts (8 experts), which transformers' Llama cannot hold",
                       "mixture of experts", "export a dense preset's run", setup="moe_weights"),
    "import not exported": Case("`python -m tools.export_hf --import` of a folder that is no export",
                                ["tools/export_hf.py", "--import", "{tmp}", "--out", "{tmp}/back.pt"],
                                "is not an exported model: it needs config.json and model.safetensors", "--import",
                                "the folder `python -m tools.export_hf RUN --out DIR` wrote"),
}


# ---- what some cases need in their folder first --------------------------------------------
def _checkpoint(tmp: Path, cache: dict):
    """A finished two-step step-1 run with a checkpoint at each step (made once, then copied)."""
    if "checkpoint" not in cache:
        made = Path(cache["root"]) / "_checkpoint"
        code, err = run_script(S1, [a.replace("{tmp}", str(made)) for a in T] + ["--ckpt-every", "1"])
        assert code == 0, f"the run the checkpoint cases start from failed: {err}"
        (made / "out" / ".run.lock").unlink(missing_ok=True)
        cache["checkpoint"] = made / "out"
    shutil.copytree(cache["checkpoint"], tmp / "out")


def checkpoint(tmp, cache):
    _checkpoint(tmp, cache)


def unfinished(tmp, cache):
    """The checkpointed run as a crash leaves it: checkpoints, and no summary.json."""
    _checkpoint(tmp, cache)
    (tmp / "out" / "summary.json").unlink()


def bad_meta(tmp, cache):
    _checkpoint(tmp, cache)
    (tmp / "out" / "checkpoints" / "step_00000001" / "meta.json").write_text("{\"step\": 1,")


def truncated(tmp, cache):
    _checkpoint(tmp, cache)
    data = next((tmp / "out" / "checkpoints" / "step_00000001").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])


def ckpt_file(tmp, cache):
    (tmp / "out").mkdir()
    (tmp / "out" / "checkpoints").write_text("not a folder")


def make_file(tmp, cache):
    (tmp / "notes.txt").write_text("my notes")


def live_lock(tmp, cache):
    import socket
    (tmp / "out").mkdir()
    # the parent of this process: alive, and not this process (whose own lock is taken over)
    (tmp / "out" / ".run.lock").write_text(f"{os.getppid()} {socket.gethostname()}\n")


def moe_weights(tmp, cache):
    """A run folder of the debug-moe model as --save-weights leaves it (untrained weights)."""
    import torch
    from common.model import build_model, get_config
    cfg = get_config("debug-moe")
    (tmp / "moe").mkdir()
    torch.save(build_model(cfg, "cpu").state_dict(), tmp / "moe" / "weights.pt")
    (tmp / "moe" / "summary.json").write_text(json.dumps({"model": "debug-moe", "model_config": cfg.as_dict(),
                                                         "seq_len": 32}))


def bad_summary(tmp, cache):
    (tmp / "run").mkdir()
    (tmp / "run" / "summary.json").write_text('{"global_batch_size": 4, "seq_')  # a run killed mid-write


# ---- running them ------------------------------------------------------------------------------
def run_script(script: str, argv: list[str]) -> tuple[int, str]:
    """The script's main() in this process with ``argv``: (exit code, what it printed on
    stderr). tools/multirun.py's runner, which knows how to start a script a second time.
    A shell script (step 4's launchers) runs under bash instead."""
    import contextlib
    import importlib
    import io
    from tools.multirun import run_script as run
    if script.endswith(".sh"):  # a launch script: bash, in a process of its own
        import subprocess
        r = subprocess.run(["bash", script, *argv], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                           text=True, timeout=60)
        return r.returncode, r.stderr
    hook = sys.excepthook  # init_process_group chains a rank prefix onto it, once per run
    try:
        if not script.startswith("tools/"):
            return run(script, argv, capture_stderr=True)
        # a tool is a module of the tools package (its dataclasses need it in sys.modules)
        module = importlib.import_module("tools." + Path(script).stem)
        saved, sys.argv, err = sys.argv, [script, *argv], io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                code = module.main()  # a tool may return its exit code (sys.exit(main()))
            return (code if isinstance(code, int) else 0), err.getvalue()
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 1), err.getvalue()
        finally:
            sys.argv = saved
    finally:
        sys.excepthook = hook


def argv_of(case: Case, tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in case.argv]


def run_case(name: str, root: Path, cache: dict | None = None) -> dict:
    """Run one case in this process, in its own folder under ``root``: its exit code,
    stderr (the folder written as {tmp}) and seconds."""
    case = CASES[name]
    tmp = root / name.replace(" ", "_").replace("'", "")
    tmp.mkdir(parents=True, exist_ok=True)
    cache = cache if cache is not None else {}
    cache.setdefault("root", str(root))
    if case.setup:
        globals()[case.setup](tmp, cache)
    script, *argv = argv_of(case, tmp)
    t = time.perf_counter()
    code, err = run_script(script, argv)
    return {"code": code, "stderr": err.replace(str(tmp), "{tmp}"), "seconds": time.perf_counter() - t}


def applicable(case: Case) -> bool:
    if case.cpu_only:
        import torch
        return not torch.cuda.is_available()
    return True


def problems(case: Case, result: dict, limit_s: float) -> list[str]:
    """What is wrong with how a case ended ([] when it ended as it should)."""
    err, bad = result["stderr"], []
    if result["code"] in (0, None):
        bad.append(f"exit code {result['code']}, not an error")
    if "Traceback" in err:
        bad.append("a traceback")
    if case.says not in err:
        bad.append(f"no {case.says!r}")
    elif case.names not in err:
        bad.append(f"the sentence does not name {case.names!r}")
    if result["seconds"] > limit_s:
        bad.append(f"took {result['seconds']:.1f} s")
    return bad


def markdown_table() -> str:
    """The troubleshooting table of step4_multi_node/README.md."""
    lines = ["| what was tried | what you see (one line on stderr; the script exits 2, torchrun 1) | what to do |",
             "|---|---|---|"]
    for case in CASES.values():
        says = case.says.replace("|", "\\|")
        lines.append(f"| {case.did} | `...{says}...` | {case.fix} |")
    return "\n".join(lines)


def table(suffix: str = "") -> dict[str, str]:
    """For step4_multi_node/figures.py's POST_STEPS: the README block (no run needed, any device)."""
    return {} if suffix else {"misuse": markdown_table()}


def worker(names: list[str], out: str):
    """Inside one torchrun job: run the named two-rank cases one after another; rank 0
    writes every rank's results to ``out``."""
    import torch.distributed as dist
    root = Path(out).parent / "misuse_cases"  # the same --out on every rank, as a person would give
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    world = int(os.environ["WORLD_SIZE"])
    mine = {}
    for name in names:
        if os.environ["RANK"] == "0":
            print(f"[misuse] {name}", flush=True)
        mine[name] = run_case(name, root)
    store.set(f"misuse_{os.environ['RANK']}", json.dumps(mine))  # the groups the scripts made are gone
    if os.environ["RANK"] == "0":
        store.wait([f"misuse_{r}" for r in range(world)])
        Path(out).write_text(json.dumps({r: json.loads(store.get(f"misuse_{r}")) for r in range(world)}))


def two_rank_jobs(names: list[str], out: str, timeout_s: float = 150) -> int:
    """The named two-rank cases one after another in one torchrun job (rank 0 says which
    starts, so a hang names its case); every rank's results in ``out``. (`--fail-rank 2` on
    two ranks, once refused after DDP's first collectives, hung in gloo's teardown about one
    run in three: it is refused at parse time now, before any process group exists.)"""
    import subprocess
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", ",".join(names), "--json", str(out)]
    try:
        subprocess.run(cmd, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"[misuse] the two-rank job did not end within {timeout_s:.0f} s (the last case started is the one "
              f"that hung)", flush=True)
        return 1
    return 0 if Path(out).is_file() else 1


def main(argv=None):
    import argparse
    import tempfile
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--two-rank-jobs", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.two_rank_jobs is not None:
        sys.exit(two_rank_jobs(args.two_rank_jobs.split(","), args.json))
    if args.worker is not None:
        return worker(args.worker.split(","), args.json)
    with tempfile.TemporaryDirectory() as root:
        cache = {}
        for name, case in CASES.items():
            if case.ranks > 1 or not applicable(case):
                continue
            r = run_case(name, Path(root), cache)
            print(f"{name}: exit {r['code']}, {r['seconds']:.1f} s: {r['stderr'].strip()[-300:]}")


if __name__ == "__main__":
    main()
