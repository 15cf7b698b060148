"""TensorBoard event files without TensorFlow: the TFRecord framing and the few protobuf messages needed.

An event file is a sequence of records, each ``length`` (uint64 LE), the masked CRC32C of
those 8 bytes, ``data``, the masked CRC32C of ``data``; each ``data`` a serialized
``tensorboard.Event`` (``tensorboard/compat/proto/event.proto``). Only what the job's
trackers write is encoded here, by hand (protobuf's wire format):

* ``Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }``
* ``Summary { repeated Value value = 1; }``
* ``Value { string tag = 1; float simple_value = 2; TensorProto tensor = 8; SummaryMetadata metadata = 9; }``
* a text summary: ``metadata { plugin_data { plugin_name: "text" } }`` and a scalar ``DT_STRING``
  tensor (``TensorProto { dtype = 1 (DT_STRING = 7); tensor_shape = 2 (empty: a scalar); string_val = 8 }``).

The first record of a file is ``file_version: "brain.Event:2"``. File names are
``events.out.tfevents.<seconds>.<host>.<pid>.<n>``: TensorBoard reads the files of a
directory in name order, so a later writer (a new leader) continues the run in a new file.
:func:`read_events` reads a file back (stopping at a record cut short by a crash) for the
writer to know which steps are already there; the tests use TensorBoard's own reader.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FILE_PREFIX = "events.out.tfevents."
FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord frame of ``data``."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data))


# -- protobuf's wire format ---------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: negatives as two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def scalar_value(tag: str, value: float) -> bytes:
    """A ``Summary.Value`` with ``simple_value`` (a float32, as TensorBoard keeps scalars)."""
    return _bytes(1, tag.encode()) + _field(2, 5, struct.pack("<f", value))


def text_value(tag: str, text: str) -> bytes:
    """A ``Summary.Value`` the text plugin shows: a scalar string tensor."""
    metadata = _bytes(1, _bytes(1, b"text"))  # SummaryMetadata.plugin_data.plugin_name
    tensor = _field(1, 0, _varint(7)) + _bytes(2, b"") + _bytes(8, text.encode())  # DT_STRING, shape [], string_val
    return _bytes(1, tag.encode()) + _bytes(8, tensor) + _bytes(9, metadata)


def event(wall_time: float, step: int, values: list[bytes] | None = None, *, file_version: str = "") -> bytes:
    """A serialized ``Event`` holding ``values`` (from :func:`scalar_value`, :func:`text_value`)."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version:
        out += _bytes(3, file_version.encode())
    if values:
        out += _bytes(5, b"".join(_bytes(1, v) for v in values))
    return out


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a message: ints for varints and fixed fields, bytes for the rest."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(buf, i)
            yield number, wire, v
        elif wire == 1:
            yield number, wire, int.from_bytes(buf[i:i + 8], "little")
            i += 8
        elif wire == 5:
            yield number, wire, int.from_bytes(buf[i:i + 4], "little")
            i += 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            yield number, wire, buf[i:i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire} is not read here")


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


@dataclass(frozen=True)
class ReadEvent:
    """An event read back: its step and the tags of its values."""

    step: int
    tags: tuple[str, ...]


def read_events(path: Path, *, check_all: bool = False) -> list[ReadEvent]:
    """The events of one file, in order; a record cut short or damaged ends the reading there. Each record's
    length is checked by its CRC; its data's CRC only for the last record (where a writer that died leaves a
    damaged one) unless ``check_all``: a pure-Python CRC costs about 20 us a record."""
    data = path.read_bytes()
    out: list[ReadEvent] = []
    i = 0
    while i + 12 <= len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != masked_crc(head) or i + 16 + n > len(data):
            break
        body = data[i + 12:i + 12 + n]
        last = i + 16 + n + 12 > len(data)
        if (check_all or last) and struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != masked_crc(body):
            break
        i += 16 + n
        step, tags = 0, []
        for number, _, v in _fields(body):
            if number == 2 and isinstance(v, int):
                step = v - (1 << 64) if v >= 1 << 63 else v
            elif number == 5 and isinstance(v, bytes):
                for _, _, value in _fields(v):
                    tags += [t.decode(errors="replace") for num, _, t in _fields(value)  # type: ignore[arg-type]
                             if num == 1 and isinstance(t, bytes)]
        out.append(ReadEvent(step, tuple(tags)))
    return out


class EventFileWriter:
    """Appends events to a new event file in ``directory`` (made if needed); each write is flushed.

    Raises OSError when the directory or the file cannot be made (the caller decides what that means).
    """

    def __init__(self, directory: Path, *, wall: float | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time() if wall is None else wall
        base = f"{FILE_PREFIX}{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        n = 0
        while (directory / f"{base}.{n}").exists():
            n += 1
        self.path = directory / f"{base}.{n}"
        self._file = open(self.path, "xb")  # noqa: SIM115 (kept open while the job runs)
        self.write(event(now, 0, file_version=FILE_VERSION))

    def write(self, data: bytes) -> None:
        self._file.write(record(data))
        self._file.flush()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
