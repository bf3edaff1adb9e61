"""TensorFlow's checkpoint format (the "tensor bundle" of `variables/variables.*`), read without
TensorFlow: what a TF-Hub module or a `tf.compat.v1.train.Saver` checkpoint holds.

    entries = read_index(Path("module/variables/variables.index"))   # name -> BundleEntry
    arrays = read_tensors(Path("module/variables/variables"), entries, ["bilm/char_embed"])

The files, as TensorFlow writes them:

* `PREFIX.index` is a LevelDB-style sorted table: data blocks of prefix-compressed entries
  (shared-key length, own-key length, value length as varints, then the key's own bytes and the
  value), each block ending in its restart offsets (uint32s) and their count (uint32), and
  followed by a 5-byte trailer (a compression byte, 0 = none, and the masked CRC32C of the block
  and that byte); an index block whose values are the data blocks' handles (offset, size
  varints); a 48-byte footer holding the metaindex and index handles, zero padding and the magic
  number 0xdb4775248b80fb57 (little-endian).
* Its entry under the empty key is a `BundleHeaderProto` (shard count, endianness); every other
  entry maps a tensor's name to a `BundleEntryProto`: dtype (field 1), shape (2: a
  `TensorShapeProto` of dims with a size each), shard id (3), offset (4) and size (5) in the
  shard's data file, the masked CRC32C of the tensor's bytes (6), slices (7: partitioned
  variables, not read here).
* `PREFIX.data-0000S-of-0000N` holds the tensors' bytes, raw little-endian arrays in C order.

Every size is checked against the files it points into before anything is allocated, and every
CRC is checked: a truncated, damaged or hostile checkpoint is one `WeightFileError` naming the
file and what was wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elmokit.model.errors import WeightFileError, check_finite

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
BLOCK_TRAILER_BYTES = 5  # compression type (1 byte) + masked CRC32C (4 bytes)
MAX_INDEX_BYTES = 64 * 2**20  # an index lists names and offsets: a few KB for ELMo's 50-odd tensors
MAX_DIMS = 32

# TensorFlow's DataType enum values that are arrays of fixed-size numbers, and their numpy dtype
# (little-endian); DT_BFLOAT16 (14) has no numpy dtype and is widened to float32 when read.
NUMERIC_DTYPES: dict[int, str] = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?",
                                  14: "<u2", 19: "<f2"}
DTYPE_NAMES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
               9: "int64", 10: "bool", 14: "bfloat16", 19: "float16"}
FLOAT_DTYPES = (1, 2, 14, 19)


@dataclass(frozen=True)
class BundleEntry:
    """Where one tensor lives: its dtype (TensorFlow's enum), shape, data file shard, offset and
    size in bytes, and the CRC32C of those bytes (None where the entry has none)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    crc32c: int | None
    sliced: bool

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, f"dtype {self.dtype}")


# ---------------------------------------------------------------------------------------------
# CRC32C (Castagnoli), as LevelDB and TensorFlow mask it
# ---------------------------------------------------------------------------------------------
_POLYNOMIAL = 0x82F63B78  # reflected


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLYNOMIAL), table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()


def _zeros_operator(n_bytes: int) -> np.ndarray:
    """The linear map (over GF(2)) that `n_bytes` zero bytes apply to the CRC register, as the
    images of its 32 basis vectors (uint32, shape (32,))."""
    result = np.array([1 << bit for bit in range(32)], dtype=np.uint32)  # identity
    power = _apply_bytes(result, np.zeros(1, np.uint8))  # one zero byte
    while n_bytes:
        if n_bytes & 1:
            result = _apply_operator(power, result)
        power = _apply_operator(power, power)
        n_bytes >>= 1
    return result


def _apply_bytes(registers: np.ndarray, data: np.ndarray) -> np.ndarray:
    for byte in data:
        registers = _TABLE[(registers ^ byte) & 0xFF] ^ (registers >> 8)
    return registers


def _apply_operator(operator: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`operator` (32 basis images) applied to every uint32 of `values`."""
    result = np.zeros_like(values)
    for bit in range(32):
        result ^= operator[bit] * ((values >> np.uint32(bit)) & np.uint32(1))
    return result


def crc32c(data: bytes | np.ndarray) -> int:
    """The CRC32C of `data`, computed in lanes: the bytes are cut into equal chunks (zeros in front,
    which leave a zero register unchanged), each chunk's register is run at once across all lanes,
    and the chunks' registers are folded pairwise, the left one carried past the right one's bytes
    by the zero-bytes operator. Linear in the bytes, no Python loop over them."""
    data = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else \
        np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    n_bytes = data.size
    chunk = max(1, min(4096, math.isqrt(n_bytes)))
    n_chunks = 1 << max(0, math.ceil(math.log2(max(1, -(-n_bytes // chunk)))))
    padded = np.zeros(n_chunks * chunk, dtype=np.uint8)
    padded[padded.size - n_bytes:] = data
    lanes = np.ascontiguousarray(padded.reshape(n_chunks, chunk).T)  # (chunk, n_chunks)
    registers = np.zeros(n_chunks, dtype=np.uint32)
    for row in lanes:
        registers = _TABLE[(registers ^ row) & 0xFF] ^ (registers >> 8)
    width = chunk
    while registers.size > 1:
        registers = _apply_operator(_zeros_operator(width), registers[0::2]) ^ registers[1::2]
        width *= 2
    # The standard CRC starts from all ones and inverts the result.
    start = _apply_operator(_zeros_operator(n_bytes), np.array([0xFFFFFFFF], dtype=np.uint32))[0]
    return int(~(start ^ registers[0]) & 0xFFFFFFFF)


MASK_DELTA = 0xA282EAD8


def unmask_crc(masked: int) -> int:
    """LevelDB's masking undone: stored = rotate_right(crc, 15) + 0xa282ead8."""
    rotated = (masked - MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Protocol buffers and varints: the few wire types the index uses
# ---------------------------------------------------------------------------------------------
class _Truncated(ValueError):
    pass


def _varint(buffer: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(buffer) or shift > 63:
            raise _Truncated("a varint runs past its record")
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7


def _fields(message: bytes) -> dict[int, list]:
    """field number -> values of a protobuf message (varints as ints, fixed32/64 as ints,
    length-delimited as bytes)."""
    fields: dict[int, list] = {}
    position = 0
    while position < len(message):
        key, position = _varint(message, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(message, position)
        elif wire == 1:
            if position + 8 > len(message):
                raise _Truncated("a fixed64 runs past its record")
            value, position = int.from_bytes(message[position:position + 8], "little"), position + 8
        elif wire == 2:
            length, position = _varint(message, position)
            if position + length > len(message):
                raise _Truncated("a length-delimited field runs past its record")
            value, position = message[position:position + length], position + length
        elif wire == 5:
            if position + 4 > len(message):
                raise _Truncated("a fixed32 runs past its record")
            value, position = int.from_bytes(message[position:position + 4], "little"), position + 4
        else:
            raise ValueError(f"protobuf wire type {wire} (field {number}) is not one TensorFlow writes here")
        fields.setdefault(number, []).append(value)
    return fields


def _entry(name: str, value: bytes) -> BundleEntry:
    fields = _fields(value)
    dims = []
    for shape in fields.get(2, []):
        shape_fields = _fields(shape)
        if shape_fields.get(3, [0])[0]:
            raise ValueError("its shape has an unknown rank")
        for dim in shape_fields.get(2, []):
            size = _fields(dim).get(1, [0])[0]
            dims.append(size - (1 << 64) if size >= 1 << 63 else size)  # int64 on the wire
    if len(dims) > MAX_DIMS or any(size < 0 for size in dims):
        raise ValueError(f"its shape {dims[:MAX_DIMS]} is not a tensor's")
    first = {number: values[0] for number, values in fields.items()}
    return BundleEntry(name=name, dtype=first.get(1, 0), shape=tuple(dims), shard=first.get(3, 0),
                       offset=first.get(4, 0), size=first.get(5, 0), crc32c=first.get(6),
                       sliced=bool(fields.get(7)))


# ---------------------------------------------------------------------------------------------
# The index: a LevelDB-style table
# ---------------------------------------------------------------------------------------------
def _block(index: bytes, handle: bytes, path: Path, what: str) -> bytes:
    """The contents of the block a handle points to, after checking its bounds, compression and CRC."""
    offset, position = _varint(handle, 0)
    size, _ = _varint(handle, position)
    end = offset + size + BLOCK_TRAILER_BYTES
    if end > len(index) - FOOTER_BYTES:
        raise WeightFileError(f"{path}: its {what} (bytes {offset:,}..{end:,}) runs past the end of the file "
                              f"({len(index):,} bytes): truncated or not a TensorFlow checkpoint index")
    contents, kind = index[offset:offset + size], index[offset + size]
    stored = int.from_bytes(index[offset + size + 1:end], "little")
    if crc32c(index[offset:offset + size + 1]) != unmask_crc(stored):
        raise WeightFileError(f"{path}: the CRC32C of its {what} does not match: the file is damaged")
    if kind != 0:
        raise WeightFileError(f"{path}: its {what} is compressed (type {kind}); TensorFlow writes checkpoint "
                              "indexes uncompressed, and elmokit reads only those")
    return contents


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """(key, value) of every entry of a block, keys rebuilt from their shared prefixes."""
    if len(block) < 4:
        raise _Truncated("a block shorter than its restart count")
    n_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 - 4 * n_restarts
    if end < 0:
        raise _Truncated("a block's restart array runs past it")
    entries, key, position = [], b"", 0
    while position < end:
        shared, position = _varint(block, position)
        own, position = _varint(block, position)
        length, position = _varint(block, position)
        if shared > len(key) or position + own + length > end:
            raise _Truncated("an entry runs past its block")
        key = key[:shared] + block[position:position + own]
        position += own
        entries.append((key, block[position:position + length]))
        position += length
    return entries


def read_index(path: Path) -> dict[str, BundleEntry]:
    """name -> BundleEntry of every tensor a checkpoint index lists (the header entry checked:
    one data shard at least, little-endian)."""
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise WeightFileError(f"{path}: {size:,} bytes, more than a checkpoint index of any model "
                              f"({MAX_INDEX_BYTES:,}): not an index")
    index = path.read_bytes()
    if len(index) < FOOTER_BYTES or int.from_bytes(index[-8:], "little") != TABLE_MAGIC:
        raise WeightFileError(f"{path}: not a TensorFlow checkpoint index (no table footer with its magic number; "
                              f"{len(index):,} bytes): truncated, or another kind of file")
    try:
        footer = index[-FOOTER_BYTES:-8]
        _, position = _varint(footer, 0)  # the metaindex's handle: offset,
        _, position = _varint(footer, position)  # size (the metaindex is empty in a bundle)
        entries: dict[str, BundleEntry] = {}
        header = None
        for _, handle in _block_entries(_block(index, footer[position:], path, "index block")):
            for key, value in _block_entries(_block(index, handle, path, "data block")):
                name = key.decode("utf-8", errors="replace")
                if not key:
                    header = _fields(value)
                    continue
                try:
                    entries[name] = _entry(name, value)
                except ValueError as error:
                    raise WeightFileError(f"{path}: the entry of {name!r} is not a tensor's: {error}") from None
    except _Truncated as error:
        raise WeightFileError(f"{path}: truncated or damaged checkpoint index ({error})") from None
    except ValueError as error:
        if isinstance(error, WeightFileError):
            raise
        raise WeightFileError(f"{path}: not a TensorFlow checkpoint index ({error})") from None
    if header is None:
        raise WeightFileError(f"{path}: no bundle header (the entry under the empty key): not a TensorFlow "
                              "checkpoint index")
    if header.get(2, [0])[0] != 0:
        raise WeightFileError(f"{path}: a big-endian checkpoint; elmokit reads little-endian ones")
    n_shards = header.get(1, [1])[0]
    for entry in entries.values():
        if entry.shard >= n_shards:
            raise WeightFileError(f"{path}: tensor {entry.name!r} is in shard {entry.shard} of {n_shards}")
    return entries


def data_file(prefix: Path, shard: int, n_shards: int) -> Path:
    """TensorFlow's name of a shard's data file: PREFIX.data-00000-of-00001."""
    return prefix.with_name(f"{prefix.name}.data-{shard:05d}-of-{n_shards:05d}")


def shard_count(prefix: Path) -> int:
    """The shard count of the data files beside an index (from their names)."""
    counts = {name.rsplit("-of-", 1)[-1] for name in (p.name for p in prefix.parent.glob(prefix.name + ".data-*-of-*"))}
    numbers = sorted(int(count) for count in counts if count.isdigit())
    if len(numbers) != 1:
        raise WeightFileError(f"{prefix.parent}: expected {prefix.name}.data-00000-of-0000N files of one shard "
                              f"count, found {sorted(p.name for p in prefix.parent.glob(prefix.name + '.data-*'))}")
    return numbers[0]


def read_tensors(prefix: Path, entries: dict[str, BundleEntry], names: list[str]) -> dict[str, np.ndarray]:
    """The float arrays of `names` (float32; float64, float16 and bfloat16 widened or narrowed to
    float32), each checked before it is read: a float dtype, a size that is its shape's, bytes
    inside its data file, and after reading, its CRC32C and finite values."""
    n_shards = shard_count(prefix)
    arrays = {}
    for name in names:
        entry = entries[name]
        path = data_file(prefix, entry.shard, n_shards)
        if entry.sliced:
            raise WeightFileError(f"{prefix}.index: tensor {name!r} is partitioned into slices; elmokit reads "
                                  "whole tensors only")
        if entry.dtype not in FLOAT_DTYPES:
            raise WeightFileError(f"{prefix}.index: tensor {name!r} is {entry.dtype_name}, expected floating point")
        itemsize = np.dtype(NUMERIC_DTYPES[entry.dtype]).itemsize
        declared = math.prod(entry.shape) * itemsize
        if entry.size != declared:
            raise WeightFileError(f"{prefix}.index: tensor {name!r} of shape {entry.shape} ({entry.dtype_name}) "
                                  f"needs {declared:,} bytes, its entry says {entry.size:,}")
        if not path.is_file():
            raise WeightFileError(f"{path}: missing (the data file of tensor {name!r})")
        available = path.stat().st_size
        if entry.offset + entry.size > available:
            raise WeightFileError(f"{path}: tensor {name!r} is at bytes {entry.offset:,}..{entry.offset + entry.size:,} "
                                  f"but the file has {available:,}: truncated")
        with open(path, "rb") as handle:
            handle.seek(entry.offset)
            raw = np.frombuffer(handle.read(entry.size), dtype=np.uint8)
        if entry.crc32c is not None and crc32c(raw) != unmask_crc(entry.crc32c):
            raise WeightFileError(f"{path}: the CRC32C of tensor {name!r} does not match its index entry: the "
                                  "file is damaged")
        arrays[name] = _as_float32(raw, entry)
        check_finite(path, f"tensor {name!r}", arrays[name])
    return arrays


def _as_float32(raw: np.ndarray, entry: BundleEntry) -> np.ndarray:
    if entry.dtype == 14:  # bfloat16: the high half of a float32
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        with np.errstate(over="ignore"):  # float64 past float32's range: inf, refused by check_finite
            values = raw.view(NUMERIC_DTYPES[entry.dtype]).astype(np.float32)
    return values.reshape(entry.shape)
