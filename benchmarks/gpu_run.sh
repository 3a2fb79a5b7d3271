#!/usr/bin/env bash
# The GPU figures: run on the device machine after ../shared/gpu/stage's two calls.
#   bash .gpu-b/install.sh && . /tmp/gpu-env.sh && bash benchmarks/gpu_run.sh [stage...]
# Stages (default: decode overhead peers-low peers-high), each for every model in $MODELS:
#   decode      benchmarks/decode_step.py --profile (llama-3.2-1b only: the shape of our H100 overhead figures)
#   overhead    benchmarks/overhead.py at $CONCURRENCY (1 8 32 64 128 256), warmed up, at least
#               $MIN_REQUESTS (64) requests a level (8 waves at 8 streams); $OVERHEAD_ARGS
#               adds options (e.g. "--prefix-cache off": what keeping prompts' blocks costs, which
#               needs "--block-tokens 16": the default 256 keeps no block of a 128-token prompt;
#               "--worker prefill_pad=0 --worker fuse_prefill=false": our side with the GPU's
#               prefill defaults before 2026-11-27, to compare with today's)
#   overhead-4bit  the same for a 4-bit copy of each model (`mlx_lm.convert -q`, made once under
#               /tmp), kept quantized (`--dequantize no`: on CUDA "auto" dequantizes small models),
#               at $CONCURRENCY (64): the fold of quantized layers against mlx-lm's loop (not default)
#   peers-low   benchmarks/peers.py, all four backends at 1 8 32
#   peers-high  benchmarks/peers.py at 64 128 256, without sequential stream_generate (it would
#               take minutes per level: one request at a time)
#   attribute   benchmarks/overhead.py --attribute at 64: where our time per step goes, and the
#               ratio without the lag ticker (not a default stage)
# More stages (not default; `bash benchmarks/gpu_run.sh quant settings single settings-8b`):
#   quant       benchmarks/cuda_settings.py --quant: an 8B layer's matmuls, bf16 against 4-bit
#   settings    benchmarks/cuda_settings.py: CUDA graphs on/off, ops per graph; bare decode step
#               (masked, mask-free) and bare loop / scheduler tok/s at 1 8 64 256 streams
#   single      benchmarks/peers.py at 1 stream (bare, scheduler, sequential stream_generate),
#               with CUDA graphs on and off (GRAPHS="1 0"; GRAPHS=0: what cuda_graphs = "auto" picks for these)
#   settings-8b the settings stage for a random llama-3.1-8B bf16 shape (built first, ~105 s),
#               graphs on and off: decode steps, and bare loop / scheduler at $STREAMS streams
#   quant-step  benchmarks/cuda_settings.py --quant-step: the 8B shape's whole decode step in bf16,
#               with its layers 4-bit, then all 4-bit (embedding and lm_head too), and lm_head alone
#   host-cost   benchmarks/host_cost.py at $HOST_CONC (256): the worker's and the loop's time per step by
#               phase, with the worker's GIL wait; $HOST_ARGS adds options ("--switch-interval 0.0005").
#               At 256 streams on an H100 the scheduler's tok/s swing by up to 2x between runs, in the
#               worker's step (docs/host-cost.md): this says whether that step waits for the GIL.
#               HOST_ARGS="--py-spy /tmp/site/bin/py-spy" samples one more scheduler run at each
#               level (after its table; from its first timed request, not the scheduler's start;
#               in no figure; on an H100 at 256 streams with SmolLM2 a run on 3x the prompts did not
#               end in 80 s under native sampling) and prints where the worker's time between two
#               steps went (on a fresh machine the first runs compile kernels: never sample a fixed
#               delay from the process's start). Fetch $OUT in the call that sees the job end: a
#               machine left idle 30 s is given back with its files
#   one-stream  benchmarks/one_stream.py: one request at a time, stream_generate / bare loop /
#               engine adapter / scheduler, TTFT and ITL, with a trace of each hop
# Time limits: LIMIT_S (any stage), SETTINGS_S, SINGLE_S, SETTINGS8B_S. The 2026-11-23 run used
# LIMIT_S=90 SETTINGS_S=110 SINGLE_S=40 SETTINGS8B_S=150 in one 590 s call, too little for quant,
# single (its peers.py runs build a no-EOS copy first), ops250 and settings-8b: give each of those
# 150-300 s.
#   cluster     benchmarks/cluster.py --parts b: tokens/s on 1 and on 2 Ray Serve replicas sharing
#               the GPU (qwen2.5-0.5b only: its step is host-bound). Not a default stage; needs
#               ray[serve] (the cluster extra) staged by benchmarks/stage_ray.sh in two halves
#               (Ray's wheels are ~117 MB, over one call's carry): two more calls, see its header.
#   ray-path    benchmarks/peers.py at $RAY_CONC (1 64 256): the in-process scheduler, `serve` and one
#               Ray Serve replica (`ray_one.py`) side by side on one GPU, the Ray path's cost
#               (qwen2.5-0.5b only; RAY_BACKENDS adds variants such as ray:stream_interval_s=0,
#               ray:frontends=2 or 'ray:ingress="proxy"' (Serve's HTTP proxy, the default until 2026-11-27); RAY_WAVES, default 2, requests per stream: at 64 streams two waves
#               of 64-token requests are a run of about 1.3 s on an H200, too short for a 10% margin;
#               RAY_ARGS adds options, e.g. "--clients 4": at 256 streams one client process read
#               the tokens in bursts on 2026-11-27, near its limit)
#   cluster2    benchmarks/cluster.py on two GPUs, one replica each (8 CPUs each), $CLUSTER_PARTS
#               (default b): (a) prefix routing, ours against power-of-two, 512-token prefixes
#               in 1024-block pools; (b) tokens/s on 1 and 2 replicas, 256 requests x 64 tokens
#               at once; (c) a replica killed 4 s into 512 requests at concurrency 128. Model
#               names in $MODELS may be named models (smollm2-135m, staged by
#               benchmarks/stage_smollm2.sh); both need Ray staged (the cluster stage). $CLUSTER_ARGS
#               adds options (e.g. "--py-spy PATH": each process's stacks in (b)'s second round;
#               "--connections 100 0": the client's cap on open streams, both interleaved;
#               "--clients 4": each round sent by 4 client processes, as one caps at ~2,000 tok/s;
#               "--frontends 1 2": each deployment with one frontend process, then two;
#               "--cluster stream_feed=false": a [cluster] key for every deployment;
#               '--worker-key cuda_graphs="on"': a [worker] key for every deployment;
#               '--model-key dequantize="no"': a [model] key, here SmolLM2 kept quantized (on a
#               fresh H200 its kernels took over 4.5 minutes to build: give it LIMIT_S=900);
#               "--cluster pin_cpus=true": each replica on physical cores of its own; part (b)
#               prints where each replica's busiest thread ran, and how often two shared a core;
#               "--tp-pairs 2": one replica then two, twice in turn, a ratio per pair: one replica's
#               speed drifted between deployments by more than two replicas');
#               TP_MAX_TOKENS and TP_REPEAT lengthen (b)'s rounds (64 tokens: a round of 2-4 s, too
#               short to pin the two-replica ratio down within 10%)
#   padded-attention benchmarks/padded_attention.py: our kernel for padded decode rows' attention
#               checked against MLX's masked path, and both timed (runs once, whatever $MODELS holds;
#               $PA_ARGS adds options, e.g. "--shapes 16x8x128 --length 2000")
#   settings-read benchmarks/settings_read.py: whether a first start's GGUF conversion leaves MLX's CUDA
#               settings unread (MODELS=smollm2-135m, staged by benchmarks/stage_smollm2.sh)
#   cold-start  benchmarks/cold_start.py: a fresh process's first rounds (256 requests at once) with an
#               empty kernel directory, with and without the load-time kernel build (a quantized
#               model's matmuls, every model's engine warm-up), then a second process on the built
#               directory (MODELS=smollm2-135m for the real model; give it LIMIT_S=600 when it stays
#               quantized: each variant may take a third of it, and a cold build took 45-140 s)
#   stall       benchmarks/stall.py: the closed loop of prompts of 64-512 tokens at $STALL_CONC streams
#               (32 64), 48 tokens each, $STALL_S (10) s a run counted after a ramp of $STALL_RAMP
#               (5) s (the loop's start is a burst: stall.py --ramp; 0 counts from it), $REPEAT (2) rounds, for each of
#               $STALL_VARIANTS (default "0 auto"; flags such as 0:queued, 0:mlxpad: stall.py's header);
#               $STALL_ARGS adds options ("--max-tokens 96 --max-tokens-min 16": varied output lengths).
#               On an H100 each in-process run takes about 19 s and each mlx_lm.server run 46 s, and a
#               fresh machine's first process 30 s more to build kernels: "0 auto" at REPEAT=3 needs
#               LIMIT_S=150 a cell (180 for the first), with mlx_lm.server 290. LIMIT_S applies to each
#               cell; a cell cut short keeps the runs it finished in its JSON ("complete": false)
#   mixed-step  benchmarks/mixed_step.py: a prefill chunk inside the decode step's forward pass
#               against the two passes apart, host build and wall ms ($MIXED_CHUNKS, prompts x tokens;
#               MIXED_ARGS=--vary: a new chunk length every step)
#   side-stream benchmarks/side_stream.py: a prefill chunk ($SIDE_CHUNKS, prompts x tokens) queued on the
#               decode's stream or on a stream of its own beside a pipelined decode of 64 rows
#   prefill-thread benchmarks/prefill_thread.py: a pass of $THREAD_CHUNKS (prompts x tokens) queued on the
#               decode's stream every 6 steps, or passes back to back on a second thread and stream,
#               beside a pipelined decode of 64 rows: the decode's gaps, and the work both got done
#   carry-graph benchmarks/carry_graph.py: the primitives a step hands MLX on this backend, a decode step
#               alone, one carrying a plan's chunk whole, and each share of one spread over 2-4 steps
#               ([worker] prefill_spread), for narrow copies of the 1B and 0.5B layouts (runs once)
#   prefill-parts benchmarks/prefill_parts.py: one batched prefill pass of 8 prompts of 64-512 tokens,
#               part by part, synchronized (plain pass, batch cache, right padding, finalize, join),
#               with cuDNN's attention off (the default) and on (CUDNN="0 1")
#   kernel-trace benchmarks/kernel_trace.py: the closed loop of the stall stage (64 streams) under PyTorch's
#               CUDA profiler, each kernel charged to the step that launched it: device busy ms and kernels a
#               step, decode-only steps against prefilling ones, for $TRACE_VARIANTS ("0 512"); needs the
#               image's torch beside MLX's CUDA build; TRACE_ARGS="--api-sites --cache-gb 8" adds the
#               allocations, frees and waits a step, with the Python sites of those in unified memory;
#               "--launches" the kernels launched most often a step
#   cache-filter benchmarks/cache_filter.py: rows leaving a batch cache of 64 and 256 rows, copied by MLX's
#               gather (mlx-lm's filter) against by contiguous runs (ours)
#   shape-cost  benchmarks/shape_cost.py: ops of a prefilling step (a projection, attention, rope) on
#               shapes MLX has seen against new ones (model-independent: runs once per model listed)
#   served      benchmarks/peers.py at 1 8 64: our server over HTTP beside the in-process
#               scheduler and mlx_lm.server, one client for all (the served path should keep >= 0.97x of in-process at 64)
#   served-8b   the same for Llama-3.1-8B's shape (benchmarks/shapes.py builds it, ~16 GB, once),
#               served and mlx_lm.server only (not a default stage; run once, not per model)
# Writes JSON and a log under $OUT (or benchmarks/results/gpu).
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
export MLX_SCHEDULER_CACHE=${MLX_SCHEDULER_CACHE:-/tmp/mlx-scheduler-cache}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH=${PYTHONPATH:-src}:.
limit=${LIMIT_S:-400}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(decode overhead peers-low peers-high)
read -r -a models <<< "${MODELS:-qwen2.5-0.5b llama-3.2-1b}"
spec() { case $1 in smollm2-135m|*:*|*/*) echo "$1" ;; *) echo "synthetic:$1" ;; esac; }
date -u +"%F %T UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, mlx.core as mx, mlx_lm, transformers; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "transformers", transformers.__version__, "python", sys.version.split()[0], mx.default_device(), mx.device_info().get("device_name"))'
for m in "${models[@]}"; do
  echo "=== $(date +%T) build $(spec "$m")"
  timeout "$limit" python3 -c "import time; t=time.time(); from workers.loading.models import resolve_model; print(resolve_model('$(spec "$m")'), round(time.time()-t,1), 's')"
done
for s in "${stages[@]}"; do
  for m in "${models[@]}"; do
    echo "=== $(date +%T) $s $(spec "$m")"
    case $s in
      decode)
        [ "$m" = llama-3.2-1b ] || continue
        timeout "$limit" python3 -P benchmarks/decode_step.py --model "synthetic:$m" --profile \
          --batches ${BATCHES:-1 8 64} --out "$out/decode-$m.json" ;;
      overhead)
        timeout "$limit" python3 -P benchmarks/overhead.py --model "$(spec "$m")" --concurrency ${CONCURRENCY:-1 8 32 64 128 256} \
          --prompt-tokens 128 --max-tokens 64 --waves ${WAVES:-2} --min-requests ${MIN_REQUESTS:-64} --warmup 1 ${OVERHEAD_ARGS:-} \
          --out "$out/overhead-$m.json" ;;
      overhead-4bit)
        q="/tmp/q4-$m"
        [ -f "$q/config.json" ] || timeout "$limit" python3 -P -c "import sys; from mlx_lm import convert; \
from workers.loading.models import resolve_model; convert(str(resolve_model(sys.argv[1])), mlx_path=sys.argv[2], quantize=True, q_bits=4)" \
          "$(spec "$m")" "$q"
        timeout "$limit" python3 -P benchmarks/overhead.py --model "$q" --dequantize no --concurrency ${CONCURRENCY:-64} \
          --prompt-tokens 128 --max-tokens 64 --waves ${WAVES:-2} --min-requests ${MIN_REQUESTS:-64} --warmup 1 ${OVERHEAD_ARGS:-} \
          --out "$out/overhead-4bit-$m.json" ;;
      peers-low)
        timeout "$limit" python3 -P benchmarks/peers.py --model "synthetic:$m" --concurrency 1 8 32 --warmup 1 \
          --backends bare scheduler mlx_lm.server sequential --out "$out/peers-low-$m.json" ;;
      peers-high)
        timeout "$limit" python3 -P benchmarks/peers.py --model "synthetic:$m" --concurrency 64 128 256 --warmup 1 \
          --backends bare scheduler mlx_lm.server --out "$out/peers-high-$m.json" ;;
      host-cost)
        timeout "$limit" python3 -P benchmarks/host_cost.py --model "$(spec "$m")" --concurrency ${HOST_CONC:-256} \
          --prompt-tokens 128 --max-tokens 64 --repeat ${REPEAT:-3} ${HOST_ARGS:-} --out "$out/host-cost-$m.json" ;;
      stall)
        for c in ${STALL_CONC:-32 64}; do
          timeout "$limit" python3 -P benchmarks/stall.py --model "synthetic:$m" --variants ${STALL_VARIANTS:-0 auto} \
            --concurrency "$c" --prompt-min 64 --prompt-max 512 --max-tokens 48 --seconds ${STALL_S:-10} --ramp ${STALL_RAMP:-5} \
            --repeat ${REPEAT:-2} ${STALL_ARGS:-} --out "$out/stall-$m-$c.json"
        done ;;
      mixed-step)
        timeout "$limit" python3 -P benchmarks/mixed_step.py --model "$(spec "$m")" --rows ${MIXED_ROWS:-64} \
          --held 256 --chunks ${MIXED_CHUNKS:-8x512 4x512 8x128 1x256} --steps 20 --repeat ${REPEAT:-2} ${MIXED_ARGS:-} \
          --out "$out/mixed-step-$m.json" ;;
      side-stream)
        for c in ${SIDE_CHUNKS:-8x512 4x256}; do
          timeout "$limit" python3 -P benchmarks/side_stream.py --model "$(spec "$m")" --rows ${MIXED_ROWS:-64} \
            --chunk "$c" --steps 40 --at 10 --repeat ${REPEAT:-3} --out "$out/side-stream-$m-$c.json"
        done ;;
      prefill-thread)
        for c in ${THREAD_CHUNKS:-8x512 4x512}; do
          timeout "$limit" python3 -P benchmarks/prefill_thread.py --model "$(spec "$m")" --rows ${MIXED_ROWS:-64} \
            --chunk "$c" --steps 200 --every 6 --repeat ${REPEAT:-3} --out "$out/prefill-thread-$m-$c.json"
        done ;;
      carry-graph)
        [ "$m" = "${models[0]}" ] || continue
        timeout "$limit" python3 -P benchmarks/carry_graph.py --out "$out/carry-graph.json" ;;
      prefill-parts)
        for c in ${CUDNN:-0 1}; do
          MLX_CUDA_USE_CUDNN_SDPA=$c timeout "$limit" python3 -P benchmarks/prefill_parts.py --model "$(spec "$m")" \
            --prompts 8 --rows 64 --held 256 --repeat ${REPEAT:-5} --out "$out/prefill-parts-$m-cudnn$c.json"
        done ;;
      kernel-trace)
        timeout "$limit" python3 -P benchmarks/kernel_trace.py --model "$(spec "$m")" --variants ${TRACE_VARIANTS:-0 512} \
          --concurrency ${TRACE_CONC:-64} ${TRACE_ARGS:-} --out "$out/kernel-trace-$m.json" ;;
      cache-filter)
        timeout "$limit" python3 -P benchmarks/cache_filter.py --model "$(spec "$m")" --rows ${FILTER_ROWS:-64 256} \
          --repeat ${REPEAT:-5} --out "$out/cache-filter-$m.json" ;;
      shape-cost)
        timeout "$limit" python3 -P benchmarks/shape_cost.py --calls 30 --repeat ${REPEAT:-3} \
          --out "$out/shape-cost.json" ;;
      served)
        timeout "$limit" python3 -P benchmarks/peers.py --model "synthetic:$m" --concurrency ${SERVED_CONC:-1 8 64} \
          --warmup 1 --repeat ${REPEAT:-1} --backends ${SERVED_BACKENDS:-scheduler served mlx_lm.server} \
          --out "$out/served-$m.json" ;;
      served-8b)
        [ "$m" = "${models[0]}" ] || continue
        dir=$(timeout "$limit" python3 -P benchmarks/shapes.py llama-3.1-8b | tail -1) && \
        PEERS_KV_MEMORY=40GiB timeout "$limit" python3 -P benchmarks/peers.py --model "$dir" --concurrency ${SERVED_CONC:-1 8 64} \
          --warmup 1 --backends served mlx_lm.server --out "$out/served-llama-3.1-8b.json" ;;
      attribute)
        timeout "$limit" python3 -P benchmarks/overhead.py --model "$(spec "$m")" --concurrency 64 \
          --prompt-tokens 128 --max-tokens 64 --waves 4 --warmup 1 --attribute --out "$out/attribute-$m.json" ;;
      quant)
        [ "$m" = "${models[0]}" ] || continue
        timeout "$limit" python3 -P benchmarks/cuda_settings.py --models --settings default graphs_off \
          --quant --batches 1 8 64 --out "$out/cuda_settings.json" ;;
      settings)
        timeout "${SETTINGS_S:-$limit}" python3 -P benchmarks/cuda_settings.py --models "synthetic:$m" \
          --settings ${SETTINGS:-default graphs_off ops250} --deadline "${SETTINGS_S:-$limit}" \
          --batches ${BATCHES:-1 8 64 256} --streams ${STREAMS:-1 8 64 256} \
          --steps 30 --warmup-steps 5 --max-tokens ${MAX_TOKENS:-32} --out "$out/cuda_settings.json" ;;
      single)
        for g in ${GRAPHS:-1 0}; do
          MLX_USE_CUDA_GRAPHS=$g timeout "${SINGLE_S:-$limit}" python3 -P benchmarks/peers.py --model "synthetic:$m" \
            --concurrency 1 --warmup 1 --repeat ${REPEAT:-1} --backends bare scheduler sequential \
            --out "$out/single-$m-graphs$g.json" | grep -E "^ +1 |^c=1"
        done ;;
      settings-8b)
        [ "$m" = "${models[0]}" ] || continue
        timeout "${SETTINGS8B_S:-$limit}" python3 -P benchmarks/cuda_settings.py --models llama-3.1-8b \
          --settings ${SETTINGS:-default graphs_off} --streams ${STREAMS:-1 8 64 256} --steps 20 \
          --warmup-steps 5 --max-tokens ${MAX_TOKENS:-32} --timeout 400 --memory ${MEMORY_8B:-48GiB} \
          --deadline "${SETTINGS8B_S:-$limit}" --out "$out/cuda_settings.json" ;;
      quant-step)
        [ "$m" = "${models[0]}" ] || continue
        timeout "${QUANT_S:-$limit}" python3 -P benchmarks/cuda_settings.py --models llama-3.1-8b --settings default \
          --quant-step --batches ${BATCHES:-1 8 64} --steps 20 --warmup-steps 5 --timeout 400 \
          --deadline "${QUANT_S:-$limit}" --out "$out/quant_step.json" ;;
      one-stream)  # graphs as "auto" sets them for these unquantized shapes, for every loop alike
        MLX_USE_CUDA_GRAPHS=${GRAPHS:-0} timeout "$limit" python3 -P benchmarks/one_stream.py --model "synthetic:$m" --requests ${REQUESTS:-10} \
          --out "$out/one_stream-$m.json" ;;
      cluster)
        [ "$m" = qwen2.5-0.5b ] || continue
        timeout "$limit" python3 -P benchmarks/cluster.py --parts b --model "synthetic:$m" --device cuda \
          --gpus-per-replica 0.5 --cpus-per-replica 4 --max-batch 128 --tp-requests ${TP_REQUESTS:-256} \
          --tp-prompt-tokens 128 --tp-max-tokens 64 --tp-memory 16GiB --out "$out/cluster-$m.json" ;;
      ray-path)
        [ "$m" = qwen2.5-0.5b ] || continue
        timeout "$limit" python3 -P benchmarks/peers.py --model "synthetic:$m" --concurrency ${RAY_CONC:-1 64 256} \
          --warmup 1 --repeat ${REPEAT:-1} --waves ${RAY_WAVES:-2} --backends ${RAY_BACKENDS:-scheduler served ray} \
          ${RAY_ARGS:-} --out "$out/ray-path-$m.json" ;;
      padded-attention)
        [ -f "$out/padded-attention.json" ] || timeout "$limit" python3 -P benchmarks/padded_attention.py \
          ${PA_ARGS:-} --out "$out/padded-attention.json" ;;
      settings-read)
        timeout "$limit" python3 -P benchmarks/settings_read.py --model "$(spec "$m")" --out "$out/settings-read-$m.json" ;;
      cold-start)
        timeout "$limit" python3 -P benchmarks/cold_start.py --model "$(spec "$m")" --timeout $((limit / 3)) \
          --out "$out/cold-start-$m.json" ;;
      cluster2)
        timeout "$limit" python3 -P benchmarks/cluster.py --parts ${CLUSTER_PARTS:-b} --model "$(spec "$m")" \
          --device cuda --gpus-per-replica 1 --cpus-per-replica 8 --max-batch 128 --tp-requests ${TP_REQUESTS:-256} \
          --tp-prompt-tokens 128 --tp-max-tokens ${TP_MAX_TOKENS:-64} --tp-repeat ${TP_REPEAT:-3} --tp-memory 16GiB \
          --pool-blocks 1024 --prefix-tokens 512 \
          --max-tokens 8 --requests 320 --concurrency 16 --ratios ${RATIOS:-1 2} \
          --kill-requests 512 --kill-concurrency 128 --kill-after 4 ${CLUSTER_ARGS:-} --out "$out/cluster2-$m.json" ;;
      *) echo "unknown stage $s" ;;
    esac
    rc=$?  # before any command substitution below resets it
    echo "=== $(date +%T) done $s $(spec "$m") rc=$rc"
  done
done
