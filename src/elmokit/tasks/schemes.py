"""Entity tag schemes: IOB1, BIO (IOB2) and BIOES, detected from a file's tags and normalized
to BIO, the one scheme the task models, the metrics and the prediction files use.

    IOB1   an entity starts with I-; B- only where it directly follows one of the same type
    BIO    every entity starts with B-, continues with I-
    BIOES  S- a one-token entity, B- ... I- ... E- a longer one

`O` is outside every entity in all three. A tag is `O` or `PREFIX-TYPE` with a non-empty TYPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SCHEMES = ("iob1", "bio", "bioes")


def split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', ''). ValueError unless O or X-TYPE with X one of B I E S."""
    if tag == "O":
        return "O", ""
    prefix, dash, entity_type = tag.partition("-")
    if not dash or prefix not in ("B", "I", "E", "S") or not entity_type:
        raise ValueError(f"entity tag must be O or B-, I-, E-, S- followed by a type, got {tag!r}")
    return prefix, entity_type


def detect_scheme(sentences: Iterable[Sequence[str]]) -> str:
    """The scheme of a file's tag sequences: 'bioes' if any E- or S- occurs, else 'iob1' if an
    I- tag starts an entity (after O, at the start, or after another type), else 'bio'."""
    starts_with_i = False
    for tags in sentences:
        previous_type = ""
        for tag in tags:
            prefix, entity_type = split_tag(tag)
            if prefix in ("E", "S"):
                return "bioes"
            if prefix == "I" and entity_type != previous_type:
                starts_with_i = True
            previous_type = entity_type
    return "iob1" if starts_with_i else "bio"


def iob1_to_bio(tags: Sequence[str]) -> list[str]:
    """IOB1 -> BIO: an I-X becomes B-X unless the previous tag is B-X or I-X."""
    bio, previous_type = [], ""
    for tag in tags:
        prefix, entity_type = split_tag(tag)
        if prefix == "I" and entity_type != previous_type:
            tag = "B-" + entity_type
        bio.append(tag)
        previous_type = entity_type
    return bio


def bioes_to_bio(tags: Sequence[str]) -> list[str]:
    """BIOES -> BIO: S-X -> B-X, E-X -> I-X (B, I and O unchanged)."""
    renamed = {"S": "B", "E": "I"}
    bio = []
    for tag in tags:
        prefix, entity_type = split_tag(tag)
        bio.append(f"{renamed.get(prefix, prefix)}-{entity_type}" if prefix != "O" else "O")
    return bio


def to_bio(tags: Sequence[str], scheme: str) -> list[str]:
    """Tags of `scheme` (one of SCHEMES) in BIO."""
    if scheme == "iob1":
        return iob1_to_bio(tags)
    if scheme == "bioes":
        return bioes_to_bio(tags)
    if scheme == "bio":
        return list(tags)
    raise ValueError(f"tag scheme must be one of {SCHEMES}, got {scheme!r}")
