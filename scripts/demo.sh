#!/usr/bin/env bash
# The main job: fine-tune a densely pretrained CNN on real data (scikit-learn's digits) on
# RANKS MPI ranks, first dense (no pruning, plain all-reduce), then PacTrain at pruning ratios
# 0.5 and 0.8 and PacTrain+ternary at 0.8, and print one comparison table.
set -euo pipefail
ranks=${1:-4}
out=${PACMPI_DEMO_DIR:-results/demo}
mkdir -p "$out"
common=(--pretrained "$out/pretrained.pt" --epochs "${PACMPI_DEMO_EPOCHS:-3}" --no-progress)

train() {
  local name=$1
  shift
  echo "== $name"
  pacmpi-run -n "$ranks" --oversubscribe --timeout 1200 -- \
    python -m pacmpi.cli train "${common[@]}" --json "$out/$name.json" "$@"
}

train dense --method dense --ratio 0
train pactrain-0.5 --method pactrain --ratio 0.5
train pactrain-0.8 --method pactrain --ratio 0.8
train pactrain-ternary-0.8 --method pactrain-ternary --ratio 0.8
python scripts/demo_report.py "$out"/dense.json "$out"/pactrain-0.5.json \
  "$out"/pactrain-0.8.json "$out"/pactrain-ternary-0.8.json
