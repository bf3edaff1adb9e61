#!/usr/bin/env bash
# Train an ELMo biLM on Penn Treebank on a 2-core CPU (docs/training.md, "A real run: PTB").
# Re-running the script continues the run from its last checkpoint (--resume).
#   usage: scripts/train_ptb.sh [RUN_DIR]       (default runs/ptb)
set -euo pipefail
cd "$(dirname "$0")/.."
ELMO=${ELMO:-.venv/bin/elmo}
DATA=${PTB_DATA:-../shared/data/ptb}
RUN=${1:-runs/ptb}
VOCAB=$(dirname "$RUN")/ptb-vocab.txt

[ -f "$VOCAB" ] || "$ELMO" vocab "$DATA/ptb.train.txt.gz" -o "$VOCAB"
if [ -f "$RUN/checkpoint.pt" ]; then
  exec "$ELMO" train --resume --output-dir "$RUN" --threads "${THREADS:-2}"
fi
exec "$ELMO" train --output-dir "$RUN" \
  --train "$DATA/ptb.train.txt.gz" --valid "$DATA/ptb.valid.txt" --vocab "$VOCAB" \
  --model scripts/ptb-small.json \
  --optimizer adam --lr 0.003 --lr-decay 0.5 --grad-clip 10 --dropout 0.2 \
  --batch-size 32 --unroll-steps 20 --epochs 10 --max-tokens 9000000 --softmax full \
  --eval-every 500 --eval-batch-size 64 --patience 4 \
  --bf16 --log-every 10 --checkpoint-every 50 --threads "${THREADS:-2}" --seed 0
