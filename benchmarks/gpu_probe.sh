#!/usr/bin/env bash
# Probe on the GPU machine: the actor stack's throughput at one concurrency under different
# GIL switch intervals and prefill budgets (what limits the ratio to the bare loop).
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
exec > >(tee -a "$out/probe.txt") 2>&1
export MLX_SCHEDULER_CACHE=${MLX_SCHEDULER_CACHE:-/tmp/mlx-scheduler-cache} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
m=${MODEL:-qwen2.5-0.5b}
for c in ${CONC:-64}; do
  for si in ${SWITCH:-0.005 0.0005}; do
    for b in ${BUDGETS:-0 auto}; do
      echo "=== $(date +%T) c=$c switch=$si budget=$b"
      timeout ${LIMIT_S:-120} python3 -c "
import sys, runpy; sys.setswitchinterval($si)
sys.argv=['overhead','--model','synthetic:$m','--concurrency','$c','--waves','${WAVES:-4}','--prompt-tokens','128','--budget','$b','--out','$out/probe-$c-$si-$b.json']
runpy.run_path('benchmarks/overhead.py', run_name='__main__')" 2>&1 | grep -E "^ +c=|Error|error" 
    done
  done
done
