#!/usr/bin/env bash
# Do TorchInductor's compile workers slow a host-bound config's short probe (bench/README.md,
# probe fidelity)? When a process loads its first Triton kernel, even from the compile cache,
# TorchInductor starts a sidecar process that imports torch and forks a worker per CPU; it stops
# them only after a minute idle, so they sit beside a short probe's timed windows but not a long
# run's. Short probes of one config (the studies' own length) under three variants, in
# interleaved rounds, every other round in reverse order, on a warm TorchInductor cache (a first
# probe fills it and is recorded as variant "prime"):
#   keep      the pool left to TorchInductor (autotune probe --keep-compile-workers): started at
#             the first compile, workers left running
#   quiesce   the default: the probe starts the pool at its setup, and after its warm-up waits
#             for the workers to be up and stops them (autotune/compile_workers.py)
#   threads1  TORCHINDUCTOR_COMPILE_THREADS=1: no pool at all
# Each probe records the host's busy fraction per window (window_host.host_busy_fraction).
# Usage, from the repository root on a GPU host: bench/compile_pool.sh OUT.jsonl CONFIG_JSON [ROUNDS]
# TOP=1: each probe runs under bench/host_top.py, which writes OUT.top.VARIANT.ROUND.jsonl (the
# processes and threads that used the host's CPUs, second by second).
# (PRESET=tiny DEVICE=cpu SAMPLES=640: a CPU smoke run; no Triton there, so no pool to stop)
set -euo pipefail
out=${1:?OUT.jsonl}; config=${2:?CONFIG_JSON}; rounds=${3:-3}
samples=()
[[ -n ${SAMPLES:-} ]] && samples=(--samples "$SAMPLES")
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
probe() {  # variant, round
    local variant=$1 round=$2 line
    local args=() env=()
    [[ $variant == keep ]] && args=(--keep-compile-workers)
    [[ $variant == threads1 ]] && env=(TORCHINDUCTOR_COMPILE_THREADS=1)
    local top=()
    [[ -n ${TOP:-} ]] && top=(python3 "$(dirname "$0")/host_top.py" --out "${out%.jsonl}.top.$variant.$round.jsonl" --)
    line=$(env "${env[@]}" "${top[@]}" python3 -m autotune.cli probe --preset "${PRESET:-full}" --device "${DEVICE:-cuda}" \
        --config "$config" --json "${samples[@]}" "${args[@]}" | tail -1)
    printf '{"variant": "%s", "round": %s, "result": %s}\n' "$variant" "$round" "$line" >> "$out"
    python3 -c '
import json, statistics, sys
r = json.loads(sys.argv[3])
busy = [w["host_busy_fraction"] for w in r["window_host"] if w.get("host_busy_fraction") is not None]
cw = r.get("compile_workers") or {}
print(sys.argv[1], sys.argv[2], round(r["throughput_samples_per_s"] or 0), "samples/s;",
      "host busy", round(statistics.median(busy), 3) if busy else None, "; compile workers", cw.get("workers"),
      "cpu_s", cw.get("worker_cpu_s"), "wait_s", cw.get("wait_s"))' "$variant" "$round" "$line"
}
: > "$out"
probe prime -1
for ((r = 0; r < rounds; r++)); do
    order=(keep quiesce threads1); ((r % 2)) && order=(threads1 quiesce keep)
    for v in "${order[@]}"; do probe "$v" "$r"; done
done
