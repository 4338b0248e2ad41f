#!/usr/bin/env bash
# The main job: fine-tune a pretrained CNN on real data (scikit-learn's digits) on RANKS MPI
# ranks over a shaped 100 Mbit/s link (unshaped where this machine cannot shape one; see
# demo_link.sh), dense, then PacTrain at pruning ratios 0.5 and 0.8 and PacTrain+ternary at
# 0.8, and print one table: time per step, time to a target accuracy, bytes, accuracy.
set -euo pipefail
ranks=${1:-4}
out=${PACMPI_DEMO_DIR:-results/demo}
here=$(dirname "$0")
mkdir -p "$out"
link=$(bash "$here/demo_link.sh")
if [[ $link == none ]]; then shaping=(--oversubscribe); else shaping=(--link "$link"); fi
echo "== fine-tuning on $ranks ranks, link $link: dense, PacTrain 0.5, 0.8, PacTrain+ternary 0.8"
status=0
pacmpi-run -n "$ranks" "${shaping[@]}" --timeout 900 -- \
  python "$here/demo_train.py" --link "$link" --epochs "${PACMPI_DEMO_EPOCHS:-5}" \
  --target-fraction 0.98 --pretrained "$out/pretrained_e1.pt" --json "$out/demo.json" || status=$?
if ((status == 3)); then  # pacmpi-run: the link's calibration was refused
  echo "demo: the shaped link ran too far off $link (a busy machine?): run it again, or" \
    "PACMPI_DEMO_LINK=none make demo to run unshaped" >&2
fi
((status == 0)) || exit "$status"
echo
python "$here/demo_report.py" "$out/demo.json"
