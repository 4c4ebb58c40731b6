#!/usr/bin/env python3
"""Load benchmark of `kvq serve`: N concurrent streaming clients, each sending a prompt of
exactly P token ids (distinct slices of the reference corpus, so no prefix is shared) and
getting exactly T tokens back (greedy, with kvq's `ignore_eos` extension, so no request ends
early at the end-of-sequence token; a request that returns another count is an error).

Reports per run: requests, generated tokens, wall time, output and total (prompt + output)
tokens/s, time to first token p50/p99, inter-token latency p50/p99 (gaps between the streamed
chunks of one request), time per output token (a request's decode time over its tokens after
the first) p50/p99, and the KV pool the server reports in /metrics.

Two ways to run it:
  against a running server:
    scripts/serve_bench.py --url http://127.0.0.1:8080
  or starting the servers itself, one per mode, modes alternated --repeats times:
    scripts/serve_bench.py --kvq target/release/kvq --serve-args "--max-batch 64 --kv-memory 2G" \\
        --mode dense= --mode kv4="--kv-bits 4" --repeats 2
  (each run then prints one JSON line, and a Markdown table of all runs comes last).

Prompts come from --corpus (default: ../shared/reference/corpus-first65536-token-ids.txt
beside the repository); where there is no such file, from seeded random token ids in
[--synthetic-lo, --synthetic-hi), and the output says so. Standard library only.
"""
import argparse
import http.client
import json
import os
import random
import shlex
import signal
import subprocess
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS_NAME = "corpus-first65536-token-ids.txt"


def percentile(xs, q):
    """Nearest-rank percentile (q in 0..100) of a non-empty list; NaN for an empty one."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def post_stream(url, body):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def one_request(url, prompt, max_tokens, out):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        conn, r = post_stream(url, body)
    except OSError as e:
        out.append({"error": f"connection: {e}"})
        return
    if r.status != 200:
        out.append({"error": f"{r.status} {r.read()[:200]!r}"})
        conn.close()
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
        if "error" in chunk:
            out.append({"error": json.dumps(chunk)[:200]})
            conn.close()
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    n = usage["completion_tokens"] if usage else None
    if n != max_tokens:
        out.append({"error": f"{n} tokens instead of {max_tokens}"})
        return
    out.append({
        "ttft": (times[0] - t0) if times else None,
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "tpot": (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None,
        "tokens": n,
    })


def prompts_for(a):
    """`clients` prompts of `prompt_tokens` ids, and where they came from."""
    paths = [a.corpus] if a.corpus else [
        os.path.join(HERE, "..", "..", "shared", "reference", CORPUS_NAME),
        os.path.join(HERE, "..", "shared", "reference", CORPUS_NAME),
    ]
    for p in paths:
        if os.path.exists(p):
            with open(p) as f:
                ids = [int(t) for t in f.read().split()]
            need = a.clients * a.prompt_tokens
            if len(ids) < need:
                raise SystemExit(f"{p} has {len(ids)} ids; {need} are needed")
            return [ids[i * a.prompt_tokens:(i + 1) * a.prompt_tokens]
                    for i in range(a.clients)], "corpus"
    if a.corpus:
        raise SystemExit(f"--corpus {a.corpus}: no such file")
    rng = random.Random(0)
    return [[rng.randrange(a.synthetic_lo, a.synthetic_hi) for _ in range(a.prompt_tokens)]
            for _ in range(a.clients)], "synthetic"


def kv_pool(url):
    """The main KV pool's format and blocks, from /metrics."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith('kvq_kv_blocks_total{pool="main"'):
            fmt = line.split('format="', 1)[1].split('"', 1)[0]
            return {"kv_format": fmt, "kv_blocks": int(float(line.rsplit(" ", 1)[1]))}
    return {}


def bench(url, prompts, a, label, source):
    # One short request first: the first forward pass pays one-off costs. Its ids start no
    # benchmark prompt, so it leaves nothing in the prefix cache that they could reuse.
    warm = []
    one_request(url, list(range(100, 116)), 4, warm)
    if "error" in warm[0]:
        raise SystemExit(f"warm-up request failed: {warm[0]['error']}")
    out = []
    threads = [threading.Thread(target=one_request, args=(url, p, a.max_tokens, out))
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
    tpot = [o["tpot"] for o in ok if o["tpot"] is not None]
    r = {
        "label": label,
        "clients": a.clients,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "prompts": source,
        "ok": len(ok),
        "errors": len(errors),
        "first_errors": errors[:3],
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(tokens / wall, 2),
        "total_tok_per_s": round((tokens + len(ok) * a.prompt_tokens) / wall, 2),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 1),
        "tpot_p50_ms": round(1000 * percentile(tpot, 50), 1),
        "tpot_p99_ms": round(1000 * percentile(tpot, 99), 1),
    }
    r.update(kv_pool(url))
    print(json.dumps(r), flush=True)
    return r


class Server:
    """`kvq serve --port 0` with the given flags; stderr goes to `log`."""

    def __init__(self, kvq, args, log):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([kvq, "serve", "--host", "127.0.0.1", "--port", "0"] + args,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = threading.Event()
        self.url = None

        def drain():
            for line in self.proc.stderr:
                self.log.write(line)
                self.log.flush()
                if self.url is None and line.startswith("kvq serve: listening on "):
                    self.url = line.split("listening on ", 1)[1].strip()
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(900) or self.url is None:
            self.stop()
            raise SystemExit(f"kvq serve {' '.join(args)} did not start: see {log}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def table(rows):
    head = ("| run | KV | output tok/s | total tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
            "| TPOT p50 / p99 (ms) | wall (s) | ok |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r.get('kv_format', '?')} | {r['output_tok_per_s']} | "
            f"{r['total_tok_per_s']} | {r['ttft_p50_s']} / {r['ttft_p99_s']} | "
            f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | "
            f"{r['wall_s']} | {r['ok']}/{r['clients']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (else --kvq starts one per mode)")
    ap.add_argument("--kvq", help="the kvq binary to start servers with")
    ap.add_argument("--serve-args", default="", help="flags every started server gets")
    ap.add_argument("--mode", action="append", default=[],
                    help="NAME=FLAGS: one server per mode (repeatable), e.g. kv4='--kv-bits 4'")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all modes, alternated")
    ap.add_argument("--log-dir", default=".", help="where started servers' stderr goes")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--corpus", help="token ids, whitespace-separated")
    ap.add_argument("--synthetic-lo", type=int, default=100)
    ap.add_argument("--synthetic-hi", type=int, default=30000)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    if (a.url is None) == (a.kvq is None):
        ap.error("give one of --url and --kvq")
    prompts, source = prompts_for(a)
    if a.url:
        bench(a.url, prompts, a, a.label, source)
        return
    modes = []
    for m in a.mode or ["default="]:
        name, _, flags = m.partition("=")
        modes.append((name, shlex.split(flags)))
    rows = []
    for rep in range(a.repeats):
        for name, flags in modes:
            args = shlex.split(a.serve_args) + flags
            log = os.path.join(a.log_dir, f"serve-{name}-{rep + 1}.log")
            s = Server(a.kvq, args, log)
            try:
                rows.append(bench(s.url, prompts, a, f"{name} #{rep + 1}", source))
            finally:
                s.stop()
    print(table(rows))


if __name__ == "__main__":
    main()
