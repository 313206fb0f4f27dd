#!/usr/bin/env python3
"""Compares flashmoe's logits with llama.cpp's for one GGUF (plain Python, no
packages): mean / max KL(llama || flashmoe) over positions, max |dlogit|, the
median over positions of the per-position max |dlogit|, top-1 agreement.

usage: gguf_check.py LLAMA_LOGITS.safetensors FLASHMOE_LOGITS.safetensors NAME"""
import json
import math
import struct
import sys
from array import array


def load(path):
    raw = open(path, 'rb').read()
    n = struct.unpack('<Q', raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for k, e in hdr.items():
        if k == '__metadata__':
            continue
        b, en = e['data_offsets']
        a = array('f' if e['dtype'] == 'F32' else 'q')
        a.frombytes(raw[8 + n + b:8 + n + en])
        out[k] = (e['shape'], a)
    return out


def log_softmax(row):
    m = max(row)
    s = math.log(sum(math.exp(x - m) for x in row)) + m
    return [x - s for x in row]


ref, got, name = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
(n, v), a = ref['logits']
(n2, v2), b = got['logits']
assert (n, v) == (n2, v2), f'shapes differ: {(n, v)} vs {(n2, v2)}'
kls, maxd, per_pos, top1 = [], 0.0, [], 0
for t in range(n):
    ra, rb = a[t * v:(t + 1) * v], b[t * v:(t + 1) * v]
    la, lb = log_softmax(ra), log_softmax(rb)
    kls.append(sum(math.exp(x) * (x - y) for x, y in zip(la, lb)))
    d = max(abs(x - y) for x, y in zip(ra, rb))
    per_pos.append(d)
    maxd = max(maxd, d)
    top1 += max(range(v), key=ra.__getitem__) == max(range(v), key=rb.__getitem__)
per_pos.sort()
print(f'| {name} | {sum(kls) / n:.3g} | {max(kls):.3g} | {maxd:.3g} | {per_pos[n // 2]:.3g} | {top1 / n:.3f} |')
