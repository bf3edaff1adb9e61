#!/usr/bin/env bash
# Package the built-in English model from the Gutenberg run (scripts/train_gutenberg.sh): a float16
# copy of the run's best model WITH its softmax in src/elmokit/models/gutenberg-en (so that
# `elmo perplexity FILE` works with no model argument), with its config, vocabulary, training
# curve, metrics and the commands that made it; then its perplexities, computed from the shipped
# float16 files by the very command a user runs, and the wheel's size (at most 40 MB).
#   usage: scripts/build_builtin.sh [WORK_DIR]      (default runs/gutenberg-v3)
#   env:   FROM (best, default, or last: the last checkpoint's model),
#          EVAL_SENTENCES (default 5000: the first sentences of valid and of test to score),
#          BUILTIN_OUT (default src/elmokit/models/gutenberg-en),
#          VERSION (default v3: the version the model card and the README's model table give it)
set -euo pipefail
cd "$(dirname "$0")/.."
ELMO=${ELMO:-.venv/bin/elmo}
WORK=${1:-runs/gutenberg-v3}
RUN=$WORK/run
OUT=${BUILTIN_OUT:-src/elmokit/models/gutenberg-en}  # BUILTIN_OUT: elsewhere, for a dry run
N=${EVAL_SENTENCES:-5000}

rm -rf "$OUT.partial" && mkdir -p "$OUT.partial"
# FROM=last: the run's last model (the end of its anneal) instead of best/ (its best validation)
if [ "${FROM:-best}" = last ]; then  # provenance.json from the checkpoint's progress and its validation
  "$ELMO" export "$RUN" --last --native "$OUT.partial" --dtype float16 --overwrite
else
  "$ELMO" export "$RUN" --native "$OUT.partial" --dtype float16 --overwrite  # best/'s provenance.json with it
fi
cp "$RUN/curves.png" "$RUN/metrics.jsonl" "$RUN/train_config.json" "$OUT.partial/"
cp scripts/train_gutenberg.sh scripts/gutenberg-cpu.json "$OUT.partial/"
# the user's command: elmo prepare SPLIT.txt.gz -o DIR; elmo perplexity 'DIR/*.txt.gz' --max-sentences N
for split in valid test; do
  "$ELMO" perplexity "$OUT.partial" "$WORK/$split/shard-*.txt.gz" --max-sentences "$N" --json \
    > "$WORK/perplexity-$split-$N.json"
done
python3 - "$OUT.partial" "$WORK" "$N" "${VERSION:-v3}" <<'PY'
import json, sys
from pathlib import Path
out, work, n, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
card = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").exists() else {}
for split in ("valid", "test"):
    card[f"{split}_first_{n}_sentences"] = json.loads((work / f"perplexity-{split}-{n}.json").read_text())
card["corpus"] = "gutenberg-en (677 public-domain books, Project Gutenberg), train split, elmo prepare (sentencex + sacremoses)"
card["commands"] = "scripts/train_gutenberg.sh (copied here as train_gutenberg.sh), then scripts/build_builtin.sh"
card["stored"] = "float16, softmax included (computed in float32)"
card["version"] = version
(out / "provenance.json").write_text(json.dumps(card, indent=2) + "\n")
PY
# the weights' fingerprint (what task runs and docs/results.json record of the biLM they used)
.venv/bin/python - "$OUT.partial" <<'PY'
import json, sys
from pathlib import Path
from elmokit.sources.loading import load_model
from elmokit.model.weights import model_fingerprint
out = Path(sys.argv[1])
card = json.loads((out / "provenance.json").read_text())
card["fingerprint"] = model_fingerprint(load_model(out))[:16]
(out / "provenance.json").write_text(json.dumps(card, indent=2) + "\n")
PY
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
du -sh "$OUT"; ls -la "$OUT"
# the wheel a user installs: at most 40 MB
rm -rf "$WORK/wheel" && .venv/bin/python -m pip wheel . --no-deps --no-build-isolation -q -w "$WORK/wheel"
python3 - "$WORK"/wheel/elmokit-*.whl <<'PY'
import os, sys
size = os.path.getsize(sys.argv[1])
print(f"{sys.argv[1]}: {size / 2 ** 20:.1f} MB")
sys.exit(0 if size <= 40 * 2 ** 20 else f"the wheel is {size / 2 ** 20:.1f} MB, more than 40 MB")
PY
