import struct
import zlib

import pytest

from gds_kv_connector.format.records import (CRC_OFFSET, HEADER_SIZE, BlockHeader, FormatError, file_size_for,
                                          parse_header)

FP, KEY, PARENT = b"F" * 32, b"K" * 32, b"P" * 32
H = BlockHeader(FP, KEY, 1 << 20, 0x1234_5678_9ABC_DEF0, 1, 32, 42, PARENT)


def test_round_trip_and_size():
    raw = H.pack()
    assert len(raw) == HEADER_SIZE
    assert parse_header(raw, fingerprint=FP, key=KEY, payload_len=1 << 20, file_size=file_size_for(1 << 20)) == H
    assert file_size_for(1) == 2 * 4096 and file_size_for(4096) == 8192


def _patch(raw: bytes, offset: int, data: bytes, fix_crc: bool = True) -> bytes:
    b = bytearray(raw)
    b[offset:offset + len(data)] = data
    if fix_crc:
        b[CRC_OFFSET:CRC_OFFSET + 4] = struct.pack("<I", zlib.crc32(bytes(b[:CRC_OFFSET])))
    return bytes(b)


@pytest.mark.parametrize("offset,data,match", [
    (0, b"XXXXXXXX", "magic"), (8, struct.pack("<I", 2), "version"), (12, struct.pack("<I", 512), "header_size"),
    (80, struct.pack("<Q", 0), "payload_len"), (80, struct.pack("<Q", 1 << 40), "payload_len"),
    (96, struct.pack("<I", 7), "algorithm"), (100, struct.pack("<I", 0), "tokens_per_block"),
    (112, struct.pack("<I", 1), "flags"), (116, struct.pack("<I", 1), "reserved"),
])
def test_every_malformed_field_is_rejected(offset, data, match):
    with pytest.raises(FormatError, match=match):
        parse_header(_patch(H.pack(), offset, data))


def test_crc_and_tail_and_identity_checks():
    with pytest.raises(FormatError, match="header checksum"):
        parse_header(_patch(H.pack(), 20, b"\0", fix_crc=False))
    with pytest.raises(FormatError, match="reserved header tail"):
        parse_header(_patch(H.pack(), 4000, b"\1", fix_crc=False))
    with pytest.raises(FormatError, match="fingerprint"):
        parse_header(H.pack(), fingerprint=b"G" * 32)
    with pytest.raises(FormatError, match="key"):
        parse_header(H.pack(), key=b"G" * 32)
    with pytest.raises(FormatError, match="differs from the block size"):
        parse_header(H.pack(), payload_len=4096)
    with pytest.raises(FormatError, match="expected"):
        parse_header(H.pack(), file_size=4096)
    with pytest.raises(FormatError, match="header is"):
        parse_header(H.pack()[:100])
