#!/usr/bin/env python3
"""N concurrent streaming clients against a running `flashmoe serve`: the
streaming mode of server_bench.mjs for machines without node (the GPU
machine), standard library only. Each client is a process of its own (so
the clients' JSON parsing does not share one interpreter lock at thousands
of tokens/s), making REQUESTS requests of MAX_TOKENS tokens one after
another, the same requests as server_bench.mjs (temperature 0.7, a seed per
request, ignore_eos); TEMPERATURE 0: greedy (as `flashmoe bench --batch`,
whose argmax is picked on the device).

  python3 bench/server_stream_bench.py URL CLIENTS REQUESTS MAX_TOKENS [TEMPERATURE]

Prints one line in server_bench.mjs's format: aggregate generated tokens/s
(all tokens over the wall time from the first request to the last answer),
TTFT and inter-token latency percentiles; plus the decode rate: the tokens
after each request's first, over the wall time from the first answer's first
token to the last answer's end (what `flashmoe bench --batch N` measures,
without the prompts)."""
import http.client
import json
import multiprocessing as mp
import sys
import time
import urllib.parse


def one_request(url, client, i, max_tokens, temperature):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Client {client} request {i}: write a sorting function."}],
        "max_tokens": max_tokens, "temperature": temperature, "seed": client * 1000 + i, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    gaps, usage = [], None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        j = json.loads(line[6:])
        if j.get("usage"):
            usage = j["usage"]
        ch = (j.get("choices") or [{}])[0]
        d = ch.get("delta") or {}
        c = d.get("content") or d.get("reasoning_content") or d.get("tool_calls")
        now = time.perf_counter()
        if c or (first is None and ch.get("finish_reason")):
            if first is None:
                first = now
            elif c:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    conn.close()
    if usage is None:
        raise RuntimeError("no usage in the stream")
    return {"t0": t0, "first": first, "end": end, "tokens": usage["completion_tokens"], "gaps": gaps}


def client(args):
    url, c, requests, max_tokens, temperature = args
    return [one_request(url, c, i, max_tokens, temperature) for i in range(requests)]


def pct(v, p):
    a = sorted(v)
    return a[min(len(a) - 1, int(p * len(a)))] if a else float("nan")


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit("usage: server_stream_bench.py URL CLIENTS REQUESTS MAX_TOKENS [TEMPERATURE]")
    url, clients, requests, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    temperature = float(sys.argv[5]) if len(sys.argv) == 6 else 0.7
    ctx = mp.get_context("fork")
    with ctx.Pool(clients) as pool:
        t0 = time.perf_counter()
        res = [r for rs in pool.map(client, [(url, c, requests, max_tokens, temperature) for c in range(clients)]) for r in rs]
        s = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in res)
    ttfts = [r["first"] - r["t0"] for r in res]
    gaps = [g for r in res for g in r["gaps"]]
    first, end = min(r["first"] for r in res), max(r["end"] for r in res)
    decode = sum(r["tokens"] - 1 for r in res) / (end - first)
    ms = lambda x: f"{x * 1000:.1f}"
    print(f"{clients} streaming clients (temperature {temperature:g}): {tokens} tokens in {s:.2f} s = {tokens / s:.1f} tokens/s aggregate; "
          f"TTFT p50 {ms(pct(ttfts, .5))} / p90 {ms(pct(ttfts, .9))} / p99 {ms(pct(ttfts, .99))} ms; "
          f"inter-token p50 {ms(pct(gaps, .5))} / p90 {ms(pct(gaps, .9))} / p99 {ms(pct(gaps, .99))} ms; "
          f"decode {decode:.1f} tokens/s (first token to last)")


if __name__ == "__main__":
    main()
