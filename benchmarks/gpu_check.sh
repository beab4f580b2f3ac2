#!/usr/bin/env bash
# The device path on a GPU in one go, without make and without Horovod:
#
#     bash benchmarks/gpu_check.sh        (results under $OUT, else out/gpu_check)
#
# 1. the machine: nvidia-smi and the versions that matter;
# 2. the GPU tests, `python3 -m pytest -q tests/gpu` with TRITON_INTERPRET unset (compiled Triton
#    kernels against the host and PyTorch paths; tests/gpu/conftest.py loads the package without
#    Horovod where it is missing), the host path's Numba kernels compiled beside them meanwhile;
# 3. benchmarks/bench_gpu_kernels.py on cuda (float32, then bfloat16 at smaller sizes), through
#    tests/gpu/gpu_env.py for the same reason, its results.json and gpu_kernels.png to $OUT;
# 4. benchmarks/bench_compressors.py on a full-width ResNet-18: every compressor's device path on
#    cuda, then its host path on this machine's CPU, its tables in the log and its results.json as
#    $OUT/compressors_<device>.json.
# Everything printed also goes to $OUT/log. The exit status is the tests'.
#
# Variables: PYTHON (python3), GPU_CHECK_DEVICE (cuda; cpu: a dry run of this script on a
# machine without a GPU, Triton interpreted, tiny sizes), GPU_CHECK_K (a pytest -k expression),
# GPU_CHECK_BENCH (1; 0 skips the benchmarks), GPU_CHECK_WIDTH (64: bench_compressors' ResNet-18
# width) and GPU_CHECK_ITERATIONS (30: its iterations, 5 of them warm-up).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 SAFUSION_GPU_TESTS_DEVICE=$DEVICE
unset TRITON_INTERPRET HOROVOD_SAFUSION_KERNELS HOROVOD_SAFUSION_DEVICE_PATH
[ "$DEVICE" = cpu ] && export TRITON_INTERPRET=1
start=$SECONDS
stamp() { echo "== [$((SECONDS - start)) s] $*"; }

stamp "gpu_check on $(hostname) $(date -u +%FT%TZ), device $DEVICE"
command -v nvidia-smi >/dev/null && nvidia-smi
$PY - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "numba", "numpy", "scipy", "hypothesis", "pytest", "matplotlib"):
    try:
        print(f"{name:11}", importlib.import_module(name).__version__)
    except Exception as error:
        print(f"{name:11} missing ({type(error).__name__}: {error})")
print("horovod    ", "installed" if importlib.util.find_spec("horovod") else "not installed: the package loads without its __init__ (tests/gpu/gpu_env.py)")
import torch
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
EOF

stamp "host kernels compiled in the background (Numba's cache)"
$PY tests/gpu/gpu_env.py --warm-host > "$OUT/warm_host.log" 2>&1 &
warm=$!

CACHE=$(mktemp -d)  # pytest's cache, outside $OUT and the tree
tests() {
    if [ -n "${GPU_CHECK_K:-}" ]; then
        timeout "${1}" $PY -m pytest -q -o cache_dir="$CACHE" tests/gpu -k "$GPU_CHECK_K" "${@:2}"
    else
        timeout "${1}" $PY -m pytest -q -o cache_dir="$CACHE" tests/gpu "${@:2}"
    fi
}
stamp "python -m pytest -q tests/gpu"
tests 240
rc=$?
stamp "tests: exit status $rc"

if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    stamp "benchmarks/bench_gpu_kernels.py, float32"
    timeout 120 $PY tests/gpu/gpu_env.py benchmarks/bench_gpu_kernels.py --device "$DEVICE" --alternations 7 \
        --repeat 20 --out "$OUT"
    stamp "bench float32: exit status $?"
fi

wait $warm || { echo "warm-up of the host kernels failed:"; tail -20 "$OUT/warm_host.log"; }

if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    if [ "$DEVICE" = cuda ]; then
        stamp "benchmarks/bench_gpu_kernels.py, bfloat16"
        timeout 60 $PY tests/gpu/gpu_env.py benchmarks/bench_gpu_kernels.py --device cuda --dtype bfloat16 \
            --sizes 1e7 1e8 --densities 0.01 --out "$OUT/bfloat16"
        stamp "bench bfloat16: exit status $?"
    fi
fi
compressors() {  # $1: the device; the timeout comes second
    local dir
    dir=$(mktemp -d)
    stamp "benchmarks/bench_compressors.py on $1"
    timeout "$2" $PY tests/gpu/gpu_env.py benchmarks/bench_compressors.py --device "$1" --no-curves \
        --width "${GPU_CHECK_WIDTH:-64}" --iterations "${GPU_CHECK_ITERATIONS:-30}" --warmup 5 --out "$dir"
    stamp "bench_compressors on $1: exit status $?"
    cp "$dir/results.json" "$OUT/compressors_$1.json" 2>/dev/null
}
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    compressors "$DEVICE" 150
    [ "$DEVICE" = cuda ] && compressors cpu 150
fi
stamp "done"
exit "$rc"
