"""Editing a GGUF file's metadata in place of a writer: the hostile and fuzz tests take a valid
file and change, add or remove key-value pairs (any value type, arrays nested as deep as they
like), keeping its tensor infos and data. Bytes in, bytes out; no checks on what is written."""

from __future__ import annotations

import struct
from typing import Any

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


def _string(data: bytes, pos: int) -> int:
    (n,) = struct.unpack_from("<Q", data, pos)
    return pos + 8 + n


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype in SCALARS:
        return pos + struct.calcsize(SCALARS[vtype])
    if vtype == STRING:
        return _string(data, pos)
    etype, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    for _ in range(count):
        pos = _skip_value(data, pos, etype)
    return pos


def layout(data: bytes) -> tuple[dict[str, tuple[int, int]], int, int, int, int]:
    """(each key's (start, end) span, where the key-values end, where the tensor infos end, the
    data section's offset, the tensor count) of a valid little-endian GGUF v3."""
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos, spans = 24, {}
    alignment = 32
    for _ in range(n_kv):
        start = pos
        (n,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8: pos + 8 + n].decode()
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", data, pos)
        if key == "general.alignment":
            alignment = struct.unpack_from(SCALARS[vtype], data, pos + 4)[0]
        pos = _skip_value(data, pos + 4, vtype)
        spans[key] = (start, pos)
    kv_end = pos
    for _ in range(n_tensors):
        pos = _string(data, pos)
        (dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * dims + 4 + 8
    data_offset = -(-pos // alignment) * alignment
    return spans, kv_end, pos, data_offset, n_tensors


class Raw(bytes):
    """A value already encoded (written as it is)."""


def encode_value(vtype: int, value: Any) -> bytes:
    """``value`` as GGUF type ``vtype``; an array is (element type, list of values)."""
    if isinstance(value, Raw):
        return bytes(value)
    if vtype in SCALARS:
        return struct.pack(SCALARS[vtype], value)
    if vtype == STRING:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    etype, items = value
    return struct.pack("<IQ", etype, len(items)) + b"".join(encode_value(etype, v) for v in items)


def encode_kv(key: str, vtype: int, value: Any) -> bytes:
    return encode_value(STRING, key) + struct.pack("<I", vtype) + encode_value(vtype, value)


def nested_array(depth: int) -> tuple[int, Raw]:
    """(type, value) of an array of one array of ... ``depth`` deep, with one u8 at the bottom."""
    return ARRAY, Raw(struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", 0, 1) + b"\x01")


def edit(data: bytes, set_kv: dict[str, tuple[int, Any]] | None = None, drop: tuple[str, ...] = (),
         raw_kv: bytes = b"", raw_kv_count: int = 0) -> bytes:
    """``data`` with the keys of ``set_kv`` set to (type, value) (added when absent), ``drop``
    removed, and ``raw_kv`` (``raw_kv_count`` pairs, already encoded) appended to the pairs. The
    data section is kept, after padding to the alignment the new header declares (32 where it
    declares none that a reader could use)."""
    set_kv = dict(set_kv or {})
    spans, kv_end, infos_end, data_offset, n_tensors = layout(data)
    alignment = 32
    if "general.alignment" in set_kv:
        vtype, value = set_kv["general.alignment"]
        alignment = value if vtype in SCALARS and isinstance(value, int) and value > 0 else 32
    elif "general.alignment" in spans and "general.alignment" not in drop:
        alignment = struct.unpack_from("<I", data, spans["general.alignment"][1] - 4)[0]
    pairs = []
    for key, (start, end) in spans.items():
        if key not in drop:
            pairs.append(encode_kv(key, *set_kv.pop(key)) if key in set_kv else data[start:end])
    pairs += [encode_kv(key, *tv) for key, tv in set_kv.items()]
    header = data[:8] + struct.pack("<QQ", n_tensors, len(pairs) + raw_kv_count) + b"".join(pairs) + raw_kv
    header += data[kv_end:infos_end]
    header += b"\0" * (-len(header) % alignment)
    return header + data[data_offset:]
