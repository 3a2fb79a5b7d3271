#!/usr/bin/env bash
# Stages Ray Serve (the `cluster` extra) for the GPU machine, which has no network, in two halves
# that each fit one device call beside the working tree (64 MiB a call). Run it here, from the
# repository root, after ../shared/gpu/stage:   bash benchmarks/stage_ray.sh
# Then, on a warm machine after the two CUDA calls, within 30 s of each other:
#   call 3: command "bash .ray-a/keep.sh"                                  carry [".ray-a"]
#   call 4: command "bash .ray-b/install.sh && . /tmp/gpu-env.sh && MODELS=qwen2.5-0.5b bash benchmarks/gpu_run.sh cluster"
#           carry [".ray-b"]
set -euo pipefail
RAY_VERSION=${RAY_VERSION:-2.60.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.ray-a/ /.ray-b/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/wheels" "ray[serve]==$RAY_VERSION" 2>&1 | grep -v "is ignored" || true
rm -f "$work"/wheels/numpy-*.whl  # the device image has numpy 2.5
(cd "$work/wheels" && tar -cf "$work/ray.tar" ./*.whl)
size=$(stat -c %s "$work/ray.tar")
split -b $(( size / 2 + 1 )) "$work/ray.tar" "$work/part."
rm -rf .ray-a .ray-b && mkdir -p .ray-a .ray-b
mv "$work/part.aa" .ray-a/ray.part && mv "$work/part.ab" .ray-b/ray.part
cat > .ray-a/keep.sh <<'EOS'
mkdir -p $HOME/gpu-stage && cp .ray-a/ray.part $HOME/gpu-stage/ray-a && echo "Ray's first half kept; send call 4 within 30 s"
EOS
cat > .ray-b/install.sh <<'EOS'
set -e
if [ ! -d /tmp/site-ray/ray ]; then
  [ -f $HOME/gpu-stage/ray-a ] || { echo "Ray's first half missing: run .ray-a/keep.sh again, then this within 30 s" >&2; exit 3; }
  rm -rf /tmp/ray-wheels && mkdir -p /tmp/ray-wheels
  cat $HOME/gpu-stage/ray-a .ray-b/ray.part | tar -C /tmp/ray-wheels -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ray /tmp/ray-wheels/*.whl
fi
grep -q site-ray /tmp/gpu-env.sh || echo 'export PYTHONPATH=$PYTHONPATH:/tmp/site-ray PATH=/tmp/site-ray/bin:$PATH' >> /tmp/gpu-env.sh
. /tmp/gpu-env.sh
python3 -c 'import ray, ray.serve; print("ray", ray.__version__)'
EOS
du -sh .ray-a .ray-b
echo "staged. Call 3: bash .ray-a/keep.sh (carry .ray-a); call 4 within 30 s: bash .ray-b/install.sh && . /tmp/gpu-env.sh && ... (carry .ray-b)"
