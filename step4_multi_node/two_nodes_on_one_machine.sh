#!/bin/bash
# Rehearse a 2-node launch on one machine: two torchrun "nodes" of N ranks each meet at
# one c10d rendezvous on localhost, exactly as two real nodes would meet at the head
# node's address. The ranks run on the CPU and talk over gloo.
#   bash step4_multi_node/two_nodes_on_one_machine.sh step3_multi_gpu/train_ddp.py --model debug --steps 5
set -euo pipefail
SCRIPT=${1:?usage: $0 SCRIPT [FLAGS...]}
shift
# Both pretend nodes would see the same GPUs: each one's local rank 0 takes cuda:0, and NCCL
# refuses two ranks on one GPU. So the GPUs are hidden from the ranks (--device auto picks the
# CPU), and --device cuda is refused.
prev=
for arg in "$@"; do
    if [[ $arg == --device=cuda* || ( $prev == --device && $arg == cuda* ) ]]; then
        echo "error: the two pretend nodes of two_nodes_on_one_machine.sh would share this machine's GPUs," \
             "and NCCL refuses two ranks on one GPU; drop --device cuda (the rehearsal runs on the CPU)." >&2
        exit 2
    fi
    prev=$arg
done
export CUDA_VISIBLE_DEVICES=
NPROC=${NPROC:-2}
PORT=${PORT:-29517}
RDZV=(--nnodes 2 --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "local-$PORT")

torchrun "${RDZV[@]}" "$SCRIPT" "$@" &          # "node" A (whichever joins first hosts the store)
NODE_A=$!
torchrun "${RDZV[@]}" "$SCRIPT" "$@" &          # "node" B (only global rank 0 prints)
NODE_B=$!
status=0
wait $NODE_A || status=$?
wait $NODE_B || status=$?
exit $status
