#!/usr/bin/env bash
# Does a host-bound config's short probe read slow because its timed windows come early in
# the process's life (bench/README.md, probe fidelity)? Short probes of one config (the
# studies' own length) in interleaved rounds, every other round in reverse order, on a warm
# TorchInductor cache (a first probe fills it and is recorded as variant "prime"):
#   default   the warm-up a study's probe has (5 steps, at least 2 inverse-loss periods)
#   late      WARMUP_STEPS warm-up steps, and the samples for them on top: the same timed
#             windows, that many steps later in the process's life
# Usage, from the repository root on a GPU host:
#   bench/warmup_length.sh OUT.jsonl CONFIG_JSON [ROUNDS] [WARMUP_STEPS]
# (PRESET=tiny DEVICE=cpu SAMPLES=640: a CPU smoke run)
set -euo pipefail
out=${1:?OUT.jsonl}; config=${2:?CONFIG_JSON}; rounds=${3:-4}; late=${4:-800}
samples=${SAMPLES:-19200}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
probe() {  # variant, round, extra CLI arguments
    local variant=$1 round=$2; shift 2
    local line
    line=$(python3 -m autotune.cli probe --preset "${PRESET:-full}" --device "${DEVICE:-cuda}" --config "$config" \
        --json "$@" | tail -1)
    printf '{"variant": "%s", "round": %s, "result": %s}\n' "$variant" "$round" "$line" >> "$out"
    python3 -c 'import json, sys; r = json.loads(sys.argv[3]); print(sys.argv[1], sys.argv[2], round(r["throughput_samples_per_s"] or 0), "samples/s")' \
        "$variant" "$round" "$line"
}
: > "$out"
probe prime -1 --samples "$samples"
# the late variant's extra samples: its extra warm-up steps over the prime's (a study's) warm-up
extra=$(python3 -c '
import json, sys
r = json.loads(open(sys.argv[1]).readline())["result"]
print((int(sys.argv[2]) - r["warmup_steps"]) * r["config"]["effective_batch"])' "$out" "$late")
for ((r = 0; r < rounds; r++)); do
    order=(default late); ((r % 2)) && order=(late default)
    for v in "${order[@]}"; do
        if [[ $v == default ]]; then probe default "$r" --samples "$samples"
        else probe late "$r" --samples $((samples + extra)) --warmup-steps "$late"; fi
    done
done
