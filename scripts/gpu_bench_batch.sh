#!/bin/bash
# kvq bench-batch on a GPU machine at llama-batched-bench's H100 shapes, for each KV cache
# (f16, 8-bit, 4-bit) and each binary given, then kernel launches per decode step at batch 1
# and 64 through ncu (scripts/ncu_launches.py). Usage:
#   scripts/gpu_bench_batch.sh OUTDIR MODEL.gguf NAME=BINARY...   (BINARY may carry flags:
#   "deq=./kvq --dequantize")
# Every log, JSON and ncu CSV goes to OUTDIR/all.tgz; the summary is printed.
# Env: SHAPES (default "--npp 512,4096 --ntg 128 --npl 1,64"), KVS (default "f16 8 4"),
#      NCU=0 to skip the launch counts, NCU_KVS (default "f16"), NCU_NAMES (default all), EXTRA (more bench-batch flags).
set -u
dest=$1; model=$2; shift 2
out=$(mktemp -d)
trap 'tar -C "$out" -czf "$dest/all.tgz" .' EXIT
here=$(cd "$(dirname "$0")" && pwd)
shapes=${SHAPES:---npp 512,4096 --ntg 128 --npl 1,64}
kvs=${KVS:-f16 8 4}
for nb in "$@"; do
  name=${nb%%=*}; bin=${nb#*=}; own=""; case "$bin" in *" "*) own=${bin#* }; bin=${bin%% *};; esac
  for kv in $kvs; do
    flags=""; [ "$kv" != f16 ] && flags="--kv-bits $kv"
    echo "== $name kv=$kv"
    $bin bench-batch --model "$model" --device cuda $shapes $flags $own ${EXTRA:-} --json \
      > "$out/bench_${name}_${kv}.json" 2> "$out/bench_${name}_${kv}.err" || tail -3 "$out/bench_${name}_${kv}.err"
    python3 - "$out/bench_${name}_${kv}.json" <<'PY'
import json, sys
try:
    v = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no result:", e); sys.exit()
for r in v["rows"]:
    print(f"  {r['pp']:>5} x {r['pl']:>3}: S_PP {r['speed_pp']:9.1f}  S_TG {r['speed_tg']:9.1f}  "
          f"step {1e3 * r['t_tg'] / max(r['decode_steps'], 1):7.2f} ms  peak {(r['peak_device_bytes'] or 0) / 2**30:.2f} GiB")
PY
  done
done
[ "${NCU:-1}" = 0 ] && exit 0
for nb in "$@"; do
  name=${nb%%=*}; bin=${nb#*=}; own=""; case "$bin" in *" "*) own=${bin#* }; bin=${bin%% *};; esac
  case " ${NCU_NAMES:-$name} " in *" $name "*) ;; *) continue;; esac
  for pl in 1 64; do
    for kv in ${NCU_KVS:-f16}; do
      flags=""; [ "$kv" != f16 ] && flags="--kv-bits $kv"
      for tg in 2 4; do
        ncu --metrics gpu__time_duration.sum --csv --log-file "$out/ncu_${name}_${kv}_${pl}_${tg}.csv" \
          $bin bench-batch --model "$model" --device cuda --npp 16 --ntg $tg --npl $pl --no-warmup $flags $own ${EXTRA:-} \
          > /dev/null 2>&1
      done
      echo "== launches $name kv=$kv batch=$pl"
      python3 "$here/ncu_launches.py" "$out/ncu_${name}_${kv}_${pl}_2.csv" "$out/ncu_${name}_${kv}_${pl}_4.csv" 2 \
        | tee "$out/launches_${name}_${kv}_${pl}.txt" | head -12
    done
  done
done
