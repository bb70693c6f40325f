#!/bin/bash
# Rehearse a 2-node launch on one machine: two torchrun "nodes" of N ranks each meet at
# one c10d rendezvous on localhost, exactly as two real nodes would meet at the head
# node's address. On CPU the ranks talk over gloo.
#   bash step4_multi_node/two_nodes_on_one_machine.sh step3_multi_gpu/train_ddp.py --model debug --steps 5
set -euo pipefail
SCRIPT=${1:?usage: $0 SCRIPT [FLAGS...]}
shift
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
