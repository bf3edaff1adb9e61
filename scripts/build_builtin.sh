#!/usr/bin/env bash
# Package the built-in English model from the Gutenberg run (scripts/train_gutenberg.sh):
# perplexity on valid and test, then an embedding-only float16 copy in src/elmokit/models/gutenberg-en
# with its config, vocabulary, training curve, metrics and the commands that made it.
#   usage: scripts/build_builtin.sh [WORK_DIR]      (default runs/gutenberg-v2)
#   env:   EVAL_SENTENCES (default 5000: the first sentences of valid and of test to score)
set -euo pipefail
cd "$(dirname "$0")/.."
ELMO=${ELMO:-.venv/bin/elmo}
WORK=${1:-runs/gutenberg-v2}
RUN=$WORK/run
OUT=src/elmokit/models/gutenberg-en
N=${EVAL_SENTENCES:-5000}

for split in valid test; do
  zcat "$WORK/$split"/shard-*.txt.gz | awk -v n="$N" 'NR <= n' > "$WORK/$split-$N.txt"  # awk reads on: no SIGPIPE
  "$ELMO" perplexity "$RUN" "$WORK/$split-$N.txt" --json > "$WORK/perplexity-$split-$N.json"
done
rm -rf "$OUT.partial" && mkdir -p "$OUT.partial"
"$ELMO" export "$RUN" --native "$OUT.partial" --no-softmax --dtype float16
cp "$RUN/best/provenance.json" "$RUN/curves.png" "$RUN/metrics.jsonl" "$RUN/train_config.json" "$OUT.partial/"
cp scripts/train_gutenberg.sh scripts/gutenberg-cpu.json "$OUT.partial/"
python3 - "$OUT.partial" "$WORK" "$N" <<'PY'
import json, sys
from pathlib import Path
out, work, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
card = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").exists() else {}
for split in ("valid", "test"):
    card[f"{split}_first_{n}_sentences"] = json.loads((work / f"perplexity-{split}-{n}.json").read_text())
card["corpus"] = "gutenberg-en (677 public-domain books, Project Gutenberg), train split, elmo prepare (sentencex + sacremoses)"
card["commands"] = "scripts/train_gutenberg.sh (copied here as train_gutenberg.sh), then scripts/build_builtin.sh"
(out / "provenance.json").write_text(json.dumps(card, indent=2) + "\n")
PY
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
du -sh "$OUT"; ls -la "$OUT"
