#!/usr/bin/env python3
"""Writes a Qwen3.5-35B-A3B-shaped Q4_K_M GGUF with random weights (plain Python).

Why: the issue's GPU comparison asks for a 35B-A3B-shaped Q4_K_M file, which
cannot be downloaded on the offline GPU machine. The shapes are those of
Qwen3.5-35B-A3B (hidden 2048, 40 layers, 3 linear-attention layers to 1
full, 16 query / 2 KV heads of 256, 16 key / 32 value linear heads of 128,
256 experts, top 8, expert and shared-expert width 512, vocab 248320); the
types follow llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for attn_v, output,
and for attn_qkv / ffn_down_exps / ffn_down_shexp in the first and last
eighth of the layers and every third one, F32 norms / routers / ssm
vectors). Blocks are random bytes with small finite f16 scales, so the
file costs exactly what a real one costs to run; its outputs mean nothing.
Metadata (tokenizer, chat template) comes from a template GGUF of the same
architecture (coder-mini's), with the hyper-parameters replaced.

usage: gguf_random_35b.py TEMPLATE.gguf OUT.gguf [--layers N] [--experts E] [--vocab V]
  (smaller --layers / --experts / --vocab: a quick file of the same kinds, for tests)
"""
import argparse
import math
import random
import struct
import sys
from array import array

sys.path.insert(0, __import__('os').path.dirname(__file__))
from gguf_q8_to_bf16 import Reader  # noqa: E402

F32, Q6_K, Q4_K = 0, 14, 12
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210)}
SCALAR = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q', 11: 'q', 12: 'd'}


def put_value(t, v):
    if t == 8:
        b = v.encode()
        return struct.pack('<Q', len(b)) + b
    if t == 9:
        et = 8 if v and isinstance(v[0], str) else (4 if v and isinstance(v[0], int) else 6)
        return struct.pack('<IQ', et, len(v)) + b''.join(put_value(et, x) for x in v)
    return struct.pack('<' + SCALAR[t], v)


def read_kv(path):
    r = Reader(open(path, 'rb').read())
    assert r.take('I') == 0x46554747, 'not a GGUF file'
    r.take('I'), r.take('Q')
    kv = []
    for _ in range(r.take('Q')):
        k = r.string()
        t = r.take('I')
        if t == 9:  # keep the element type of arrays
            p = r.p
            et = r.take('I')
            r.p = p
            kv.append((k, t, r.value(t), et))
        else:
            kv.append((k, t, r.value(t), None))
    return kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('template')
    ap.add_argument('out')
    ap.add_argument('--layers', type=int, default=40)
    ap.add_argument('--experts', type=int, default=256)
    ap.add_argument('--vocab', type=int, default=248320)
    a = ap.parse_args()
    H, L, E, K, I, Is, V = 2048, a.layers, a.experts, 8, 512, 512, a.vocab
    nh, nkv, hd, nk, nv, dk, dv, conv = 16, 2, 256, 16, 32, 128, 128, 4
    arch = 'qwen35moe'
    hp = {
        'block_count': L, 'embedding_length': H, 'attention.head_count': nh, 'attention.head_count_kv': nkv,
        'expert_count': E, 'expert_used_count': min(K, E), 'attention.key_length': hd, 'attention.value_length': hd,
        'expert_feed_forward_length': I, 'expert_shared_feed_forward_length': Is, 'ssm.conv_kernel': conv,
        'ssm.state_size': dk, 'ssm.group_count': nk, 'ssm.time_step_rank': nv, 'ssm.inner_size': nv * dv,
        'full_attention_interval': 4, 'rope.dimension_count': 64, 'context_length': 262144,
    }
    kv = []
    for k, t, v, et in read_kv(a.template):
        short = k[len(arch) + 1:] if k.startswith(arch + '.') else None
        if short in hp:
            v = hp[short]
        elif short == 'rope.dimension_sections':
            v = [11, 11, 10, 0]
        elif k == 'general.name':
            v = 'random 35B-A3B-shaped Q4_K_M'
        elif k in ('tokenizer.ggml.tokens', 'tokenizer.ggml.token_type', 'tokenizer.ggml.scores') and len(v) < V:
            # llama.cpp takes the vocabulary size from the token list and checks
            # token_embd / output against it: pad the template's list to V with
            # unused tokens (type 5) so both engines see a V-token vocabulary.
            pad = V - len(v)
            v = v + ([f'<|random_pad_{i}|>' for i in range(pad)] if k.endswith('tokens')
                     else [5] * pad if k.endswith('token_type') else [0.0] * pad)
        kv.append((k, t, v, et))

    def more_bits(i):  # llama.cpp's use_more_bits for Q4_K_M
        return i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2

    tensors = [('token_embd.weight', [H, V], Q4_K), ('output_norm.weight', [H], F32), ('output.weight', [H, V], Q6_K)]
    for i in range(L):
        p = f'blk.{i}.'
        hi = Q6_K if more_bits(i) else Q4_K
        tensors += [(p + 'attn_norm.weight', [H], F32), (p + 'post_attention_norm.weight', [H], F32)]
        if i % 4 == 3:
            tensors += [(p + 'attn_q.weight', [H, 2 * nh * hd], Q4_K), (p + 'attn_k.weight', [H, nkv * hd], Q4_K),
                        (p + 'attn_v.weight', [H, nkv * hd], Q6_K), (p + 'attn_output.weight', [nh * hd, H], Q4_K),
                        (p + 'attn_q_norm.weight', [hd], F32), (p + 'attn_k_norm.weight', [hd], F32)]
        else:
            C = 2 * nk * dk + nv * dv
            tensors += [(p + 'attn_qkv.weight', [H, C], hi), (p + 'attn_gate.weight', [H, nv * dv], Q4_K),
                        (p + 'ssm_alpha.weight', [H, nv], Q4_K), (p + 'ssm_beta.weight', [H, nv], Q4_K),
                        (p + 'ssm_a', [nv], F32), (p + 'ssm_dt.bias', [nv], F32), (p + 'ssm_conv1d.weight', [conv, C], F32),
                        (p + 'ssm_norm.weight', [dv], F32), (p + 'ssm_out.weight', [nv * dv, H], Q4_K)]
        tensors += [(p + 'ffn_gate_inp.weight', [H, E], F32), (p + 'ffn_gate_inp_shexp.weight', [H], F32),
                    (p + 'ffn_gate_exps.weight', [H, I, E], Q4_K), (p + 'ffn_up_exps.weight', [H, I, E], Q4_K),
                    (p + 'ffn_down_exps.weight', [I, H, E], hi), (p + 'ffn_gate_shexp.weight', [H, Is], Q4_K),
                    (p + 'ffn_up_shexp.weight', [H, Is], Q4_K), (p + 'ffn_down_shexp.weight', [Is, H], hi)]
    for k_i, (k, t, v, et) in enumerate(kv):
        if k == 'general.file_type':
            kv[k_i] = (k, t, 15, et)  # MOSTLY_Q4_K_M

    rnd = random.Random(1)
    pool = rnd.randbytes(1 << 26)
    align = 32

    def count(dims):
        return math.prod(dims)

    def data(name, dims, t):
        n = count(dims)
        if t == F32:
            if name.endswith('ssm_a'):
                v = [-rnd.uniform(0.5, 2.0) for _ in range(n)]
            elif 'norm' in name:
                v = [1.0 + 0.1 * rnd.gauss(0, 1) for _ in range(n)]
            else:
                v = [0.05 * rnd.gauss(0, 1) for _ in range(n)]
            return array('f', v).tobytes()
        be, bb = BLOCK[t]
        nb = n // be
        # Random bytes as slices of one random pool at random offsets (making
        # 20 GB of fresh random bytes in Python took minutes).
        need, parts = nb * bb, []
        while need > 0:
            o = rnd.randrange(len(pool) // 2)
            take = min(need, len(pool) - o)
            parts.append(pool[o:o + take])
            need -= take
        blocks = bytearray(b''.join(parts))
        # Small finite f16 scales (extended-slice writes: one byte of every block at a time).
        def put_f16(at, value):
            lo, hi = struct.pack('<e', value)
            blocks[at::bb] = bytes([lo]) * nb
            blocks[at + 1::bb] = bytes([hi]) * nb
        if t == Q4_K:
            put_f16(0, 2e-4)
            put_f16(2, 1e-4)
        else:
            put_f16(208, 1e-3)
        return bytes(blocks)

    head = struct.pack('<IIQQ', 0x46554747, 3, len(tensors), len(kv))
    for k, t, v, et in kv:
        kb = k.encode()
        head += struct.pack('<Q', len(kb)) + kb + struct.pack('<I', t)
        if t == 9:
            head += struct.pack('<IQ', et, len(v)) + b''.join(put_value(et, x) for x in v)
        else:
            head += put_value(t, v)
    sizes, off = [], 0
    for name, dims, t in tensors:
        n = count(dims)
        size = n * 4 if t == F32 else n // BLOCK[t][0] * BLOCK[t][1]
        nb = name.encode()
        head += struct.pack('<Q', len(nb)) + nb + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', x) for x in dims)
        head += struct.pack('<IQ', t, off)
        sizes.append(size)
        off += size + (-size) % align
    head += b'\0' * ((-len(head)) % align)
    with open(a.out, 'wb') as f:
        f.write(head)
        for (name, dims, t), size in zip(tensors, sizes):
            b = data(name, dims, t)
            assert len(b) == size, name
            f.write(b + b'\0' * ((-size) % align))
    print(f'{a.out}: {len(tensors)} tensors, {off / 1e9:.2f} GB of tensor data')


if __name__ == '__main__':
    main()
