"""A small writer of TensorFlow's checkpoint format for the tests' hostile checkpoints: the layout
tests/fixtures/tfhub (written by TensorFlow itself) shows, with each field open to tampering.

    write_bundle(folder / "variables" / "variables", {"bilm/char_embed": array, ...},
                 entries={"bilm/char_embed": {"shape": (262, 10**9)}})
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from elmokit.model.tf_bundle import MASK_DELTA, TABLE_MAGIC, crc32c


def mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + MASK_DELTA) & 0xFFFFFFFF


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire: int, payload: bytes | int) -> bytes:
    key = varint(number << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 5:
        return key + int(payload).to_bytes(4, "little")
    return key + varint(len(payload)) + payload


def entry_proto(dtype: int, shape: tuple[int, ...], offset: int, size: int, crc: int | None) -> bytes:
    dims = b"".join(field(2, 2, field(1, 0, size_ & (2**64 - 1))) for size_ in shape)
    proto = field(1, 0, dtype) + field(2, 2, dims) + (field(4, 0, offset) if offset else b"") + field(5, 0, size)
    return proto + (field(6, 5, mask(crc)) if crc is not None else b"")


def block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A table block, every entry a restart point (no shared prefixes)."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += varint(0) + varint(len(key)) + varint(len(value)) + key + value
    for restart in restarts or [0]:
        body += restart.to_bytes(4, "little")
    body += len(restarts or [0]).to_bytes(4, "little")
    return bytes(body)


def with_trailer(contents: bytes) -> bytes:
    return contents + b"\x00" + mask(crc32c(contents + b"\x00")).to_bytes(4, "little")


def write_bundle(prefix: Path, tensors: dict[str, np.ndarray], entries: dict[str, dict] | None = None,
                 header: bytes = field(1, 0, 1)) -> None:
    """PREFIX.index and PREFIX.data-00000-of-00001 holding `tensors` (float32), with any entry's
    fields (dtype, shape, offset, size, crc) replaced by `entries[name]`."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    data, records = bytearray(), [(b"", header)]
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        fields = {"dtype": 1, "shape": tuple(np.shape(tensors[name])), "offset": len(data), "size": len(raw),
                  "crc": crc32c(raw), **(entries or {}).get(name, {})}
        records.append((name.encode(), entry_proto(fields["dtype"], fields["shape"], fields["offset"],
                                                   fields["size"], fields["crc"])))
        data += raw
    data_block = with_trailer(block(records))
    meta_block = with_trailer(block([]))
    index_block = with_trailer(block([(records[-1][0], varint(0) + varint(len(data_block) - 5))]))
    meta_offset = len(data_block)
    index_offset = meta_offset + len(meta_block)
    handles = (varint(meta_offset) + varint(len(meta_block) - 5) + varint(index_offset)
               + varint(len(index_block) - 5))
    footer = handles + bytes(40 - len(handles)) + TABLE_MAGIC.to_bytes(8, "little")
    prefix.with_name(prefix.name + ".index").write_bytes(data_block + meta_block + index_block + footer)
    prefix.with_name(prefix.name + ".data-00000-of-00001").write_bytes(bytes(data))
