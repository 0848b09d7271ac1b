#!/usr/bin/env bash
# The entry point of deploy/compose.yaml's `worker` service: claim free GPUs of this host,
# then exec `autotune worker --device cuda --gpus-per-trial N "$@"` on them.
#
# Why: Docker gives a `count: 1` GPU reservation GPU 0 in every container, so the replicas
# of one service (`docker compose up --scale worker=N`) cannot get a GPU each that way.
# Instead every replica sees all of the host's GPUs (`count: all`) and claims the ones it
# uses with flock(1) on a file per GPU in a directory the replicas share (the worker-cache
# volume). The lock descriptors survive the exec, so the worker process itself holds them:
# a GPU is free again the moment its worker exits, however it exits. A replica that finds
# no free GPU says so and waits for one (a spare, when scaled past the GPU count).
#
# Environment:
#   AUTOTUNE_GPUS            GPUs to choose from, e.g. "0,1,2,3" (default: every GPU torch sees)
#   AUTOTUNE_GPUS_PER_TRIAL  GPUs per trial (default 1): this many are claimed
#   AUTOTUNE_GPU_LOCK_DIR    the lock files' directory (default /var/cache/autotune/gpu-locks)
#   AUTOTUNE_GPU_WAIT_S      seconds between two tries while no GPU is free (default 30)
set -euo pipefail

per_trial=${AUTOTUNE_GPUS_PER_TRIAL:-1}
lock_dir=${AUTOTUNE_GPU_LOCK_DIR:-/var/cache/autotune/gpu-locks}
wait_s=${AUTOTUNE_GPU_WAIT_S:-30}
# number the GPUs as nvidia-smi does (PCI bus order), so GPU 3 in the logs is GPU 3 there
export CUDA_DEVICE_ORDER=PCI_BUS_ID

if [[ -n ${AUTOTUNE_GPUS:-} ]]; then
    IFS=', ' read -r -a gpus <<< "$AUTOTUNE_GPUS"
else
    count=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    gpus=()
    for ((i = 0; i < count; i++)); do
        gpus+=("$i")
    done
fi
if ((${#gpus[@]} < per_trial)); then
    echo "gpu-worker: ${#gpus[@]} GPU(s) to choose from (AUTOTUNE_GPUS='${AUTOTUNE_GPUS:-}'), fewer than" \
        "AUTOTUNE_GPUS_PER_TRIAL=$per_trial: is the NVIDIA container toolkit installed?" >&2
    exit 2
fi
mkdir -p "$lock_dir"

claimed=()
fds=()
claim() { # lock free GPUs until per_trial of them are held; on failure hold none
    local gpu fd
    claimed=()
    fds=()
    for gpu in "${gpus[@]}"; do
        exec {fd}>>"$lock_dir/gpu$gpu.lock"
        if flock --nonblock "$fd"; then
            claimed+=("$gpu")
            fds+=("$fd")
            if ((${#claimed[@]} == per_trial)); then
                return 0
            fi
        else
            exec {fd}>&-
        fi
    done
    for fd in "${fds[@]}"; do
        exec {fd}>&-
    done
    return 1
}

# while waiting this shell is PID 1 of the container: without a trap it would ignore SIGTERM
trap 'exit 143' TERM
trap 'exit 130' INT
waiting=0
until claim; do
    if ((!waiting)); then
        echo "gpu-worker: waiting for $per_trial free GPU(s) among ${gpus[*]} (the others' workers hold" \
            "them); trying every $wait_s s" >&2
        waiting=1
    fi
    sleep "$wait_s" &
    wait $!
done
trap - TERM INT

CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${claimed[*]}")
export CUDA_VISIBLE_DEVICES
echo "gpu-worker: claimed GPU(s) $CUDA_VISIBLE_DEVICES" >&2
# exec: the worker becomes this process (PID 1), so `docker stop`'s SIGTERM reaches it
exec autotune worker --device cuda --gpus-per-trial "$per_trial" "$@"
