"""Leading greedy tokens equal to the dense cache's, per reference prompt, for KV settings.

Run from the repository root after `cargo build --release`:
    python3 scripts/greedy_match.py [SETTING ...]
(all settings below, or only those named).
Each setting runs `kvq generate --temp 0 --dtype f32 --dequantize --max-tokens 48 --json` on the
12 prompts of ../shared/reference/smollm2-greedy.jsonl and counts how many leading generated ids
equal the dense cache's (near-ties flip under quantization; this measures it, nothing is asserted).
"""
import json, os, subprocess, tempfile
KVQ = "target/release/kvq"
cases = [json.loads(l) for l in open("../shared/reference/smollm2-greedy.jsonl")]
settings = {
    # `--kv-residual 0` names a part: plain widths, not the --kv-bits 4 / 3 budget's preset.
    "affine4": ["--kv-bits", "4", "--kv-residual", "0", "--kv-quant-scheme", "affine"],
    "rotated4": ["--kv-bits", "4", "--kv-residual", "0", "--kv-quant-scheme", "rotated"],
    "budget4": ["--kv-bits", "4"],
    "budget3": ["--kv-bits", "3"],
    "rotated8": ["--kv-bits", "8"],
    "k6v4": ["--kv-key-bits", "6", "--kv-value-bits", "4"],
    "split4.5": ["--kv-bits", "4.5"],
    "split3.5": ["--kv-bits", "3.5"],
    "split3.5+r64": ["--kv-bits", "3.5", "--kv-residual", "64"],
    "split3.5+r60s4": ["--kv-bits", "3.5", "--kv-residual", "60", "--kv-sinks", "4"],
    "rotated4+r32": ["--kv-bits", "4", "--kv-residual", "32"],
    "split3.5+r60s4c": ["--kv-bits", "3.5", "--kv-residual", "60", "--kv-sinks", "4", "--kv-center"],
    "split2.5+r60s4c": ["--kv-bits", "2.5", "--kv-residual", "60", "--kv-sinks", "4", "--kv-center"],
    "rotated4c": ["--kv-bits", "4", "--kv-center"],
}
import sys
if sys.argv[1:]:
    unknown = [a for a in sys.argv[1:] if a not in settings]
    if unknown:
        sys.exit(f"unknown settings {unknown}; known: {list(settings)}")
    settings = {k: settings[k] for k in sys.argv[1:]}
def run(case, extra, tmp):
    args = [KVQ, "generate", "--temp", "0", "--dtype", "f32", "--dequantize", "--max-tokens", "48", "--json"]
    if case.get("chat_template"):
        p = os.path.join(tmp, f"{case['id']}.json")
        with open(p, "w") as f:
            json.dump(case["messages"], f)
        args += ["--messages", p]
    else:
        args += ["--raw", case["prompt"]]
    out = subprocess.run(args + extra, capture_output=True, text=True)
    return json.loads(out.stdout)["tokens"]
rows = []
tmpdir = tempfile.mkdtemp()
for c in cases:
    dense = run(c, [], tmpdir)
    r = {"id": c["id"]}
    for k, extra in settings.items():
        got = run(c, extra, tmpdir)
        n = 0
        while n < min(len(got), len(dense)) and got[n] == dense[n]:
            n += 1
        r[k] = n
    r["of"] = len(dense)
    rows.append(r); print(r, flush=True)
print("totals", {k: sum(r[k] for r in rows) for k in settings}, "of", sum(r["of"] for r in rows))
