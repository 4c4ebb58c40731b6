#!/usr/bin/env python3
"""Load benchmark of `kvq serve`: N concurrent streaming clients, each sending a prompt of
exactly P token ids (distinct slices of the reference corpus, so no prefix is shared) and
asking for up to T tokens (greedy; a request ends early at the EOS, so the generated count is
the one the server reports).

Reports: requests, generated tokens, wall time, output tokens/s, time to first token p50/p99,
inter-token latency p50/p99 (gaps between streamed chunks of one request).

Standard library only. Usage:
  scripts/serve_bench.py --url http://127.0.0.1:8080 [--clients 64] [--prompt-tokens 512]
      [--max-tokens 128] [--corpus ../shared/reference/corpus-first65536-token-ids.txt]
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def one_request(url, prompt, max_tokens, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        out.append({"error": f"{r.status} {r.read()[:200]!r}"})
        return
    times = []
    usage = None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    end = time.perf_counter()
    conn.close()
    out.append({
        "start": t0,
        "end": end,
        "ttft": (times[0] - t0) if times else None,
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "tokens": usage["completion_tokens"] if usage else len(times),
    })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--corpus", default="../shared/reference/corpus-first65536-token-ids.txt")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    ids = [int(t) for t in open(a.corpus).read().split()]
    prompts = [ids[i * a.prompt_tokens:(i + 1) * a.prompt_tokens] for i in range(a.clients)]
    assert all(len(p) == a.prompt_tokens for p in prompts), "corpus too short"
    out = []
    threads = [threading.Thread(target=one_request, args=(a.url, p, a.max_tokens, out))
               for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [o["error"] for o in out if "error" in o]
    ok = [o for o in out if "error" not in o]
    tokens = sum(o["tokens"] for o in ok)
    ttft = [o["ttft"] for o in ok if o["ttft"] is not None]
    gaps = [g for o in ok for g in o["gaps"]]
    print(json.dumps({
        "label": a.label,
        "clients": a.clients,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "ok": len(ok),
        "errors": errors[:3],
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(tokens / wall, 2),
        "total_tok_per_s": round((tokens + len(ok) * a.prompt_tokens) / wall, 2),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 1),
    }))


if __name__ == "__main__":
    main()
