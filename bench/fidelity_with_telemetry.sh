#!/usr/bin/env bash
# Probe fidelity (bench/tuning.py fidelity) with the host's own telemetry beside it: nvidia-smi
# every 0.5 s (clocks, power, temperature, throttle reasons) and vmstat every second, so a
# slow window can be lined up (each probe records its start time) with what the GPU and the
# host were doing. Usage, from the repository root on a GPU host:
#   bench/fidelity_with_telemetry.sh OUT_DIR RANKS [NAME]     e.g. OUT_DIR 4,5,4,5 fidelity_h100_run4
set -euo pipefail
out=${1:?OUT_DIR}; ranks=${2:?RANKS, e.g. 4,5,4,5}; name=${3:-fidelity}
mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv,nounits -lms 500 > "$out/$name.smi.csv" &
smi=$!
vmstat -t 1 > "$out/$name.vmstat.txt" &
vm=$!
trap 'kill $smi $vm 2>/dev/null || true' EXIT
python3 bench/tuning.py fidelity --dir bench/results/tuning_h100 --only "$ranks" --out "$out/$name.json"
