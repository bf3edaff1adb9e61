"""The demo's sample sentences: 24 sentences with "play" in its senses of sport, theatre and
music (and a few others), one a line, whitespace-tokenized, and the query sentence and word of
the paper's polysemy demo. `elmo demo` embeds them and `elmo serve`'s page starts with them; both
read them from here."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SAMPLES = Path(str(files("elmokit") / "demo" / "play.txt"))
QUERY = "They play football on Sundays ."
WORD = "play"
