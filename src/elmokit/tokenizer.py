"""Raw text -> the Moses tokens that `elmo serve`, `elmo embed --tokenize`, `elmo similar --tokenize`
and the task commands' `--tokenize` feed the biLM: the one definition they all call.

    >>> import elmokit
    >>> elmokit.tokenize("It's 3.5 km, isn't it?")
    ['It', "'s", '3.5', 'km', ',', 'isn', "'t", 'it', '?']

Tokens are sacremoses' `MosesTokenizer(lang).tokenize(text, escape=False)` (no HTML escaping of
`&`, `<`, quotes: the tokens `elmo prepare` writes into a training corpus), each split again on
whitespace so that no token holds a space. The text is put in Unicode's composed form (NFC) first:
"café" typed as "cafe" + a combining acute gives the tokens of "café", not "cafe" and a lone accent.
Needs sacremoses (the `prepare` extra).
"""

from __future__ import annotations

import functools
import unicodedata

from elmokit.extras import require


CJK_LANGS = ("ja", "ko", "cjk")  # MosesTokenizer's own CJK cases, which have no nonbreaking prefixes


@functools.lru_cache(maxsize=None)
def moses_langs() -> tuple[str, ...]:
    """The language codes Moses tokenizes as themselves: those sacremoses ships nonbreaking
    prefixes for, and the CJK codes its tokenizer handles. Any other code sacremoses takes
    silently, and tokenizes as English."""
    from sacremoses.corpus import NonbreakingPrefixes

    return tuple(sorted({*NonbreakingPrefixes().available_langs.values(), *CJK_LANGS}))


def check_lang(lang: str, what: str = "lang") -> None:
    """ValueError naming `what` (the argument: "lang", "--lang") and the known codes if Moses does
    not know `lang` (`moses_langs`); needs sacremoses."""
    require("prepare", "Moses tokenization", ("sacremoses",))
    if lang not in moses_langs():
        raise ValueError(f"{what} {lang!r} is not a language Moses knows: sacremoses would tokenize it as English "
                         f"without a word; give one of {', '.join(moses_langs())} (the codes sacremoses ships "
                         "nonbreaking prefixes for, and its CJK cases ja, ko and cjk)")


@functools.lru_cache(maxsize=None)
def _moses(lang: str):
    """One sacremoses.MosesTokenizer per language, built once (its regexes are compiled on build)."""
    from sacremoses import MosesTokenizer

    check_lang(lang)
    return MosesTokenizer(lang=lang)


def tokenize(text: str, lang: str = "en") -> list[str]:
    """Split raw text into the Moses tokens elmokit's `--tokenize` and `elmo serve` embed.

    Args:
        text: one sentence or paragraph of raw text (a str; not split into sentences here).
        lang: the Moses language code ("en", "de", "fr", ...; `moses_langs`): it decides e.g. where an apostrophe
            splits ("it's" -> "it" "'s" in English, "l'homme" -> "l'" "homme" in French).

    Returns:
        The tokens, in order, none empty or holding whitespace; [] for blank text.

    Raises:
        TypeError: `text` or `lang` is not a str.
        ValueError: `lang` is not a code Moses knows (`moses_langs`).
        MissingExtraError: sacremoses is not installed (pip install 'elmokit[prepare]').
    """
    if not isinstance(text, str):
        raise TypeError(f"tokenize: text must be a str, got {type(text).__name__}")
    if not isinstance(lang, str) or not lang:
        raise TypeError(f"tokenize: lang must be a language code such as 'en', got {lang!r}")
    require("prepare", "elmokit.tokenize (Moses tokenization)", ("sacremoses",))
    text = unicodedata.normalize("NFC", text)  # decomposed accents (NFD, "e" + U+0301) would split off as tokens
    return " ".join(_moses(lang).tokenize(text, escape=False)).split()
