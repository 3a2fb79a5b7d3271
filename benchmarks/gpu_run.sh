#!/usr/bin/env bash
# The GPU figures (issue 8): run on the device machine after ../shared/gpu/stage's two calls.
#   bash .gpu-b/install.sh && . /tmp/gpu-env.sh && bash benchmarks/gpu_run.sh [models...]
# Writes JSON and a log under $OUT (or benchmarks/results/gpu).
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
export MLX_SCHEDULER_CACHE=${MLX_SCHEDULER_CACHE:-/tmp/mlx-scheduler-cache}
export PYTHONUNBUFFERED=1
limit=${LIMIT_S:-240}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device(), mx.device_info().get("device_name"))'
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen2.5-0.5b llama-3.2-1b)
for m in "${models[@]}"; do
  echo "=== $(date +%T) build synthetic:$m"
  timeout "$limit" python3 -c "import time; t=time.time(); from workers.models import resolve_model; print(resolve_model('synthetic:$m'), round(time.time()-t,1), 's')"
  echo "=== $(date +%T) overhead synthetic:$m"
  timeout "$limit" python3 benchmarks/overhead.py --model "synthetic:$m" --concurrency ${CONCURRENCY:-1 8 32 64 128 256} \
    --prompt-tokens 128 --max-tokens 64 --waves ${WAVES:-2} --out "$out/overhead-$m.json"
  echo "=== $(date +%T) done synthetic:$m rc=$?"
done
