#!/usr/bin/env bash
# Stages the default model (SmolLM2-135M-Instruct's GGUF, 98 MB) for the GPU machine, which has no
# network, in two halves that each fit one device call beside the working tree. Run it here, from
# the repository root:   bash benchmarks/stage_smollm2.sh
# Then, on a warm machine, within 30 s of each other:
#   command "bash .sm-a/keep.sh"                                  carry [".sm-a"]
#   command "bash .sm-b/install.sh && . /tmp/gpu-env.sh && ..."   carry [".sm-b"]
# install.sh installs the gguf package into /tmp/site (../shared/gpu/stage's) and puts the file where the scheduler's cache keeps it ($MLX_SCHEDULER_CACHE, default
# /tmp/mlx-scheduler-cache as in benchmarks/gpu_run.sh), so `smollm2-135m` loads with no pip.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.sm-a/ /.sm-b/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gguf=$(PYTHONPATH=src "$python" -c "from workers.loading.named import named_gguf; print(named_gguf('smollm2-135m', '$work/cache'))" | tail -1)
entry=${gguf#"$work/cache/"}
rm -rf .sm-a .sm-b && mkdir -p .sm-a .sm-b/wheels
# The GGUF reader's own package (pure Python; numpy, pyyaml, requests and tqdm are on the machine).
python3 -m pip download -q --no-deps --only-binary=:all: -d .sm-b/wheels "gguf==$("$python" -c 'from importlib.metadata import version; print(version("gguf"))')"
size=$(stat -c %s "$gguf")
split -b $(( size / 2 + 1 )) "$gguf" "$work/part."
mv "$work/part.aa" .sm-a/model.part && mv "$work/part.ab" .sm-b/model.part
cat > .sm-a/keep.sh <<'EOS'
mkdir -p $HOME/gpu-stage && cp .sm-a/model.part $HOME/gpu-stage/sm-a && echo "SmolLM2's first half kept; send the second within 30 s"
EOS
cat > .sm-b/install.sh <<EOS
set -e
cache=\${MLX_SCHEDULER_CACHE:-/tmp/mlx-scheduler-cache}
target="\$cache/$entry"
if [ ! -f "\$target" ]; then
  [ -f \$HOME/gpu-stage/sm-a ] || { echo "SmolLM2's first half missing: run .sm-a/keep.sh again, then this within 30 s" >&2; exit 3; }
  mkdir -p "\$(dirname "\$target")"
  cat \$HOME/gpu-stage/sm-a .sm-b/model.part > "\$target.tmp" && mv "\$target.tmp" "\$target"
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .sm-b/wheels/*.whl
echo "SmolLM2 at \$target: \$(sha256sum "\$target" | cut -c1-16)"
EOS
du -sh .sm-a .sm-b
echo "staged: bash .sm-a/keep.sh (carry .sm-a); within 30 s: bash .sm-b/install.sh (carry .sm-b)"
