#!/usr/bin/env bash
# The throughput bench (ops/bench/throughput.py) with the real engine, on a machine with
# a GPU and Python but no Java and no network: the device this project is sometimes lent.
# Its broker runs from the kit (ops/device/kafka_kit.py); the model is a Llama-family
# shape with random bf16 weights and the tiny tokenizer (ops/bench/random_model.py).
#
# Here, first:   python ops/device/kafka_kit.py pack      (.kit/: ~37 MiB, git-ignored)
# On the device: run(command="bash ops/device/throughput_gpu.sh", carry=[".kit"])
#
# Settings (environment): SHAPES ("1b"; "1b 8b" for both), DEVICE (cuda), DTYPE (bfloat16),
# BATCH (256), REQUESTS (2048), MAX_TOKENS (128), KS ("0 5"), KIT (.kit), WORK (a scratch
# directory, /tmp/genpipe-gpu), SHAPES="" for none; SYNTHETIC=1 adds goal (a)'s synthetic load
# (below; SYN_REQUESTS, 3072). Arguments go on to the model runs' throughput.py.
# The same script runs on a CPU machine (SHAPES=tiny DEVICE=cpu DTYPE=float32 BATCH=32
# REQUESTS=256 MAX_TOKENS=32 KS=0): tests/test_kafka_kit.py runs it so, with no java on PATH
# but the kit's.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHAPES=${SHAPES-1b} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} BATCH=${BATCH:-256}
REQUESTS=${REQUESTS:-2048} MAX_TOKENS=${MAX_TOKENS:-128} KS=${KS:-0 5} KIT=${KIT:-.kit}
WORK=${WORK:-/tmp/genpipe-gpu} PORT=${PORT:-29592} SYNTHETIC=${SYNTHETIC:-0} SYN_REQUESTS=${SYN_REQUESTS:-3072}
[ -f "$KIT/manifest.json" ] || { echo "no kit in $KIT: run 'python ops/device/kafka_kit.py pack' first" >&2; exit 2; }
rm -rf "$WORK" && mkdir -p "$WORK"
t0=$(date +%s)
if compgen -G "$KIT/wheels/*.whl" > /dev/null; then
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile \
        --target "$WORK/site" "$KIT"/wheels/*.whl
    for wheel in "$KIT"/wheels/fallback/*.whl; do  # (only where this Python lacks the module)
        [ -e "$wheel" ] || continue
        module=$(basename "$wheel" | cut -d- -f1)
        python3 -c "import $module" 2> /dev/null || PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q \
            --no-index --no-deps --no-compile --target "$WORK/site" "$wheel"
    done
fi
export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
kit_env=$(python3 ops/device/kafka_kit.py unpack --kit "$KIT" --into "$WORK/kit")  # (fails the script if it fails)
eval "$kit_env"
echo "kit unpacked in $(( $(date +%s) - t0 )) s: java $(command -v java)"

# The broker as the bench sections of BENCHMARKS.md ran it: G1, a fixed heap, its data on
# tmpfs when there is room (a disk's slow appends would be measured otherwise).
export GENPIPE_BROKER_JAVA_OPTS="${GENPIPE_BROKER_JAVA_OPTS:--Xms1g -Xmx1g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent}"
data="$WORK/broker"
if [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt 4194304 ] 2>/dev/null; then
    data=/dev/shm/genpipe-gpu-broker-$PORT; rm -rf "$data"
else
    echo "note: /dev/shm has under 4 GiB free: the broker's data is on $WORK's disk"
fi
# At exit, a start that failed too: the broker down, and its data off tmpfs (memory, not
# disk: each run left ~20 MB there for good), its log kept in $WORK.
stop_broker() {
    python3 -m workers.cli broker down --port "$PORT" --data-dir "$data" > /dev/null 2>&1 || true
    if [ "$data" != "$WORK/broker" ]; then
        cp "$data/broker.log" "$WORK/broker.log" 2> /dev/null || true
        rm -rf "$data"
    fi
}
trap stop_broker EXIT
python3 -m workers.cli broker up --port "$PORT" --data-dir "$data"

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")'
for shape in $SHAPES; do
    echo "[$(( $(date +%s) - t0 )) s] shape $shape"
    python3 ops/bench/random_model.py --shape "$shape" --out "$WORK/model-$shape" --device "$DEVICE" 2>&1 | grep -v "shards"
    # shellcheck disable=SC2086  # (KS: one word per k)
    python3 ops/bench/throughput.py --bootstrap-servers "127.0.0.1:$PORT" --engine model --model "$WORK/model-$shape" \
        --device "$DEVICE" --dtype "$DTYPE" --max-batch "$BATCH" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --k $KS --each-alone "$@" 2>&1 | grep -v -e "Loading weights" -e "shards"
    rm -rf "$WORK/model-$shape"
done
# Goal (a)'s load with the synthetic engine, on this machine's cores (on the 2-core VMs the
# engine, the worker and the broker share two): 2 ms steps, batch 256, k = 0, the default
# chunk policy and then the latency setting.
if [ "$SYNTHETIC" = 1 ]; then
    for policy in "" "--coalesce-max-delay-ms 4 --saturated-stretch 1"; do
        echo "[$(( $(date +%s) - t0 )) s] the synthetic engine, chunk policy: ${policy:-default}"
        python3 ops/bench/throughput.py --bootstrap-servers "127.0.0.1:$PORT" --step-ms 2 --max-batch 256 \
            --requests "$SYN_REQUESTS" --max-tokens 128 --k 0 --each-alone --generate-args "$policy"
    done
fi
echo "done in $(( $(date +%s) - t0 )) s"
