#!/usr/bin/env bash
# Train the built-in English model (src/elmokit/models/gutenberg-en) on ../shared/data/gutenberg-en
# on a CPU, with elmokit's own pipeline: prepare -> vocab -> train -> export (README, "The built-in model").
# Re-running the script continues the run from its last checkpoint (--resume): the run survives any
# interruption (SIGKILL included) as long as WORK_DIR does.
#   usage: scripts/train_gutenberg.sh [WORK_DIR]      (default runs/gutenberg-v3 in the repository, git-ignored)
#   env:   THREADS (default 2), MAX_TOKENS (default 0 = one epoch, 53.6M targets: v3's took 4.2 h, mostly on
#          2 threads, validations included, its metrics.jsonl's elapsed_s), TRAIN_SHARDS (default 'train.*':
#          the whole train split, all 10 book shards; v1 read 'train.0[0-2]')
# v3, the model that ships, is one whole epoch: `THREADS=2 scripts/train_gutenberg.sh /root/elmokit-runs/gutenberg-v3`
# (outside the checkout, so that it outlives a new checkout; resumed by the same command over sessions),
# packaged from its last model (`FROM=last VERSION=v3 scripts/build_builtin.sh /root/elmokit-runs/gutenberg-v3`).
# v2 was `MAX_TOKENS=12000000 THREADS=2 scripts/train_gutenberg.sh` (one session). Nothing else may run on the
# 2 cores beside a 2-thread run: its OpenMP threads then wait on each other (a 1-thread task run beside it,
# even at nice 19, took it to 73 tokens/s: v3's metrics.jsonl, step 55,560); use THREADS=1 when other work must share them.
# Shape: 2 x 512 cells -> 128 (scripts/gutenberg-cpu.json), 100k-word vocabulary, sampled softmax
# of 8,192, batch 32 x 20, float32 (bf16 autocast measured within a few percent of float32 with
# elmokit's training engine on this CPU: bench/results/train.md vs train-bf16.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ELMO=${ELMO:-.venv/bin/elmo}
DATA=${GUTENBERG_DATA:-$(cd .. && pwd)/shared/data/gutenberg-en}
WORK=${1:-runs/gutenberg-v3}
RUN=$WORK/run

# 1. Sentences and Moses tokens (sentencex + sacremoses), on all cores.
[ -f "$WORK/train/prepare.json" ] || "$ELMO" prepare "$DATA/${TRAIN_SHARDS:-train.*}.txt.gz" -o "$WORK/train"
for split in valid test; do
  [ -f "$WORK/$split/prepare.json" ] || "$ELMO" prepare "$DATA/$split.txt.gz" -o "$WORK/$split"
done
# 2. The softmax vocabulary: the 100,000 most frequent training tokens.
[ -f "$WORK/vocab.txt" ] || "$ELMO" vocab "$WORK/train/*.txt.gz" -o "$WORK/vocab.txt" --max-size 100000
# 3. Validation during training on the first 2,000 valid sentences (full valid and test at the end).
[ -f "$WORK/valid-2k.txt" ] || zcat "$WORK/valid/shard-00000.txt.gz" | awk 'NR <= 2000' > "$WORK/valid-2k.txt"  # awk reads on: no SIGPIPE under pipefail
# 4. Train (sampled softmax, float32). Validation every 5,000 steps (3.2M tokens): each one
# costs minutes (full 100k softmax), and the lr halves at every validation that does not improve,
# so noisy validations every 1,000 steps would both cost a third of the run and starve its lr
# (v2's run validated every 1,000 steps up to step 4,084, then 5,000).
# 5. The lr's schedule: constant, then falling linearly to 0 over the last fifth of the budget
# (warmup-stable-decay without warm-up): the budget in steps is the epoch's targets (tokens + one
# </S> a sentence, prepare.json) or MAX_TOKENS, over 32 x 20 a step. No halving at validations
# (--lr-decay 1): the first 2,000 valid sentences are a few books, whose ups and downs follow the
# books just read, and halving at each one that did not improve starved the lost whole-epoch run's lr.
# the budget a resume runs under is the one in its train_config.json (its max_tokens), not MAX_TOKENS
SCHEDULE_STEPS=$(python3 - "$WORK/train/prepare.json" "${MAX_TOKENS:-0}" "$RUN/train_config.json" <<'PY'
import json, math, os, sys
card = json.load(open(sys.argv[1]))
budget = int(sys.argv[2])
if os.path.exists(sys.argv[3]):
    budget = json.load(open(sys.argv[3]))["max_tokens"]
targets = card["tokens"] + card["sentences"]  # one epoch's
steps = math.ceil((min(budget, targets) if budget else targets) / (32 * 20))
start = min(round(0.8 * steps), steps - 1)
print(start, steps - start) if steps >= 2 else print(0, 0)
PY
)
read -r ANNEAL_START ANNEAL_STEPS <<< "$SCHEDULE_STEPS"
SCHEDULE=(--anneal-start "$ANNEAL_START" --anneal-steps "$ANNEAL_STEPS")
if [ -f "$RUN/checkpoint.pt" ]; then
  exec "$ELMO" train --resume --output-dir "$RUN" --threads "${THREADS:-2}" --eval-every 5000 --lr-decay 1 "${SCHEDULE[@]}"
fi
exec "$ELMO" train --output-dir "$RUN" \
  --train "$WORK/train/*.txt.gz" --valid "$WORK/valid-2k.txt" --vocab "$WORK/vocab.txt" \
  --model scripts/gutenberg-cpu.json \
  --optimizer adam --lr 0.002 --lr-decay 1 "${SCHEDULE[@]}" --grad-clip 10 --dropout 0.1 \
  --batch-size 32 --unroll-steps 20 --epochs 1 --max-tokens "${MAX_TOKENS:-0}" \
  --softmax sampled --n-samples 8192 \
  --eval-every 5000 --eval-batch-size 64 --patience 0 \
  --log-every 10 --checkpoint-every 500 --threads "${THREADS:-2}" --seed 0
