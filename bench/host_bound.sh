#!/usr/bin/env bash
# What holds a host-bound config back (bench/README.md, probe fidelity). Short probes (the
# studies' own length) of one config under variants, interleaved round by round, on a warm
# TorchInductor cache (a first, cold probe fills it and is recorded as variant "cold"):
#   base        the config as it is
#   no-pin      pin_memory false: no pin-memory thread in the training process to compete with
#               the training loop for the GIL
#   switch      Python's GIL switch interval 0.5 ms instead of 5 ms: a thread waiting for the
#               GIL gets it sooner (sys.setswitchinterval, set by a sitecustomize for the run)
# Each probe records its loop thread's busy fraction, sleeps and preemptions per window.
# Usage, from the repository root on a GPU host: bench/host_bound.sh OUT.jsonl CONFIG_JSON [ROUNDS]
# (PRESET=tiny DEVICE=cpu: a CPU smoke run)
set -euo pipefail
out=${1:?OUT.jsonl}; config=${2:?CONFIG_JSON}; rounds=${3:-2}
site=$(mktemp -d)
cat > "$site/sitecustomize.py" <<'PY'
import os
import sys

if os.environ.get("BENCH_SWITCH_INTERVAL_S"):
    sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL_S"]))
PY
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
probe() {  # variant, config JSON, extra environment
    local variant=$1 cfg=$2; shift 2
    local line
    line=$(env "$@" PYTHONPATH="$site:${PYTHONPATH:-}" python3 -m autotune.cli probe --preset "${PRESET:-full}" --device "${DEVICE:-cuda}" \
        --config "$cfg" --json | tail -1)
    printf '{"variant": "%s", "config": %s, "result": %s}\n' "$variant" "$cfg" "$line" >> "$out"
    python3 -c 'import json, sys; r = json.loads(sys.argv[2]); print(sys.argv[1], round(r["throughput_samples_per_s"] or 0), "samples/s")' "$variant" "$line"
}
no_pin=$(python3 -c 'import json, sys; c = json.loads(sys.argv[1]); c["pin_memory"] = False; print(json.dumps(c))' "$config")
probe cold "$config"
for _ in $(seq "$rounds"); do
    probe base "$config"
    probe no-pin "$no_pin"
    probe switch "$config" BENCH_SWITCH_INTERVAL_S=0.0005
done
