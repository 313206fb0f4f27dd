#!/usr/bin/env python3
"""Writes a BF16 GGUF for llama.cpp from a Q8_0 one (plain Python, no packages).

Why: llama.cpp's side of the bf16 comparison in bench/NOTES.md needs coder-mini
as a BF16 GGUF, which /work/shared/fixtures/gguf/ lacks, and PyPI (gguf,
numpy, torch for convert_hf_to_gguf.py) is unavailable here. Every tensor that
a BF16 conversion stores as BF16 (the list in tensor-types.json, written by
llama.cpp's converter) is rewritten as BF16: Q8_0 blocks dequantised (d * q,
rounded to bf16 to nearest even), F32 / F16 rounded; every other tensor and
all metadata are copied, general.file_type set to MOSTLY_BF16. The values are
the Q8_0 ones (within q8 rounding of the checkpoint's), the shapes, types and
so the compute cost are exactly those of a BF16 conversion: a speed reference,
not an accuracy one.

usage: gguf_q8_to_bf16.py IN.gguf TENSOR_TYPES.json KEY OUT.gguf
  KEY: the file's entry in tensor-types.json (e.g. coder-mini-bf16.gguf)
"""
import json
import struct
import sys
from array import array

F32, F16, Q8_0, BF16 = 0, 1, 8, 30
MOSTLY_BF16 = 32
SCALAR = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q', 11: 'q', 12: 'd'}


class Reader:
    def __init__(self, data):
        self.d, self.p = data, 0

    def take(self, fmt):
        v = struct.unpack_from('<' + fmt, self.d, self.p)
        self.p += struct.calcsize('<' + fmt)
        return v[0]

    def string(self):
        n = self.take('Q')
        s = self.d[self.p:self.p + n].decode('utf-8')
        self.p += n
        return s

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take('I'), self.take('Q')
            return [self.value(et) for _ in range(n)]
        return self.take(SCALAR[t])


def f16_to_f32(h):
    return struct.unpack('<e', struct.pack('<H', h))[0]


def f32_bits_to_bf16(bits):
    """bf16 bit patterns of an array('I') of fp32 bit patterns, round to nearest even."""
    out = array('H', bytes(2 * len(bits)))
    for i, b in enumerate(bits):
        out[i] = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return out


def to_bf16(ttype, raw, count):
    if ttype == BF16:
        return raw
    if ttype == F32:
        bits = array('I', raw)
    elif ttype == F16:
        bits = array('I', array('f', (f16_to_f32(h) for h in array('H', raw))).tobytes())
    elif ttype == Q8_0:
        vals = array('f')
        for blk in range(len(raw) // 34):
            o = blk * 34
            d = f16_to_f32(struct.unpack_from('<H', raw, o)[0])
            vals.extend(d * q for q in struct.unpack_from('<32b', raw, o + 2))
        bits = array('I', vals.tobytes())
    else:
        sys.exit(f'unsupported source tensor type {ttype}')
    assert len(bits) == count
    return f32_bits_to_bf16(bits).tobytes()


def type_size(t, count):
    return {F32: 4 * count, F16: 2 * count, BF16: 2 * count, Q8_0: count // 32 * 34}[t]


def main():
    src, types_json, key, dst = sys.argv[1:5]
    want = {name: t for name, t, _ in json.load(open(types_json))[key]}
    data = open(src, 'rb').read()
    r = Reader(data)
    assert r.take('I') == 0x46554747, 'not a GGUF file'
    version, n_tensors, n_kv = r.take('I'), r.take('Q'), r.take('Q')
    align, file_type_at = 32, None
    for _ in range(n_kv):
        k = r.string()
        t = r.take('I')
        if k == 'general.file_type':
            file_type_at = r.p
        v = r.value(t)
        if k == 'general.alignment':
            align = v
    kv_end = r.p
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take('Q') for _ in range(r.take('I'))]
        ttype, off = r.take('I'), r.take('Q')
        tensors.append((name, dims, ttype, off))
    data_start = (r.p + align - 1) // align * align

    head = bytearray(data[:kv_end])
    if file_type_at is not None:
        struct.pack_into('<I', head, file_type_at, MOSTLY_BF16)
    infos, blobs, off = bytearray(), [], 0
    for name, dims, ttype, toff in tensors:
        count = 1
        for d in dims:
            count *= d
        raw = data[data_start + toff:data_start + toff + type_size(ttype, count)]
        if want.get(name) == 'BF16':
            raw, ttype = to_bf16(ttype, raw, count), BF16
        nb = name.encode()
        infos += struct.pack('<Q', len(nb)) + nb + struct.pack('<I', len(dims))
        infos += b''.join(struct.pack('<Q', d) for d in dims) + struct.pack('<IQ', ttype, off)
        pad = (-len(raw)) % align
        blobs.append(raw + b'\0' * pad)
        off += len(raw) + pad
    out = head + infos
    out += b'\0' * ((-len(out)) % align)
    with open(dst, 'wb') as f:
        f.write(out)
        for b in blobs:
            f.write(b)


if __name__ == '__main__':
    main()
