#!/usr/bin/env bash
# Every CUDA check of the project in one run on a machine with an NVIDIA GPU (issue 32): the tests
# that skip without CUDA, smoke runs of the commands a Jetson user runs first, and the GPU benchmarks.
#
#   OUT=/some/dir ONDEVICE_TL_GIT_COMMIT=<commit> benchmarks/gpu_check.sh [tests] [smoke] [table4] ...
#                                                        [cache_reuse] [codec] [neuroflux]
#
# ONDEVICE_TL_GIT_COMMIT: the commit of the tree that travelled (a GPU machine's copy may carry an older
# .git); result files record it.
# No argument: all of them. tests, smoke and table4 (an accuracy benchmark) run side by side; the timed
# benchmarks (cache_reuse, codec, neuroflux) run after them, one at a time, with nothing beside them.
# Each step has a time limit, logs to its own file and adds a line (exit status, seconds) to steps.txt;
# after every step the logs, the run summaries and benchmarks/results/*_cuda.json are packed into
# $OUT/gpu_check.tgz, so what finished comes back even when a later step is cut off.
#
# Packages the GPU machine lacks: wheels in .whl/ (../shared/device/wheels.sh) are installed first.
# Fashion-MNIST (table4, neuroflux): Debian's idx files copied into .fmnist/ are installed where the
# fashion_mnist source looks (/usr/share/datasets/fashion-mnist).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
WORK=${WORK:-/tmp/gpu-check-work}
STORE=$WORK/store
mkdir -p "$OUT" "$WORK/logs" "$WORK/runs"
export PYTHONUNBUFFERED=1 NO_ALBUMENTATIONS_UPDATE=1 MPLBACKEND=Agg
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu checks the smoke steps' commands on a machine without a GPU

if [ -d .whl ] && ! $PY -c "import zarr, pydantic, numcodecs" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ -d .fmnist ] && [ ! -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r .fmnist /usr/share/datasets/fashion-mnist
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$WORK/gpu.txt" 2>&1
$PY -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'torchvision', torchvision.__version__, torch.cuda.get_device_name())" >> "$WORK/gpu.txt" 2>&1
cat "$WORK/gpu.txt"

pack() {
  mkdir -p "$WORK/results"
  cp benchmarks/results/*_cuda.json "$WORK/results/" 2>/dev/null
  for run in "$WORK"/runs/*/; do  # each run's summary and report, not its model files
    [ -d "$run" ] || continue
    mkdir -p "$WORK/summaries/$(basename "$run")"
    cp "$run"/summary.json "$run"/report.md "$run"/sweep.md "$run"/sweep.json \
      "$WORK/summaries/$(basename "$run")/" 2>/dev/null
  done
  local tmp="$WORK/pack.$BASHPID.tgz"  # phases pack side by side: each its own file, renamed in place
  tar czf "$tmp" -C "$WORK" logs results summaries gpu.txt steps.txt 2>/dev/null
  mv "$tmp" "$OUT/gpu_check.tgz"
  cp "$WORK/steps.txt" "$OUT/steps.txt" 2>/dev/null
}

# step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in logs/NAME.log.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$WORK/steps.txt"
  tail -n 3 "$WORK/logs/$name.log" | sed "s/^/  [$name] /"
  pack
  return $rc
}

tests() {
  step tests 200 $PY -m pytest -q -p no:cacheprovider -n 6 -o addopts="" -m "not slow" -rs \
    tests/test_cuda_data.py tests/test_cuda_train.py tests/test_device.py tests/stages/test_decode_stream.py \
    tests/methods/test_train_device.py tests/models/test_memory.py
}

smoke() {
  local qs=recipes/quickstart.yaml cpu=(env CUDA_VISIBLE_DEVICES=)
  step qs_fp32 150 $PY -m pipeline run $qs --set run.device=$DEVICE --store "$STORE" --output "$WORK/runs/qs_fp32"
  for p in fp16 bf16; do
    step "qs_$p" 90 $PY -m pipeline run $qs --set run.device=$DEVICE --store "$STORE" --output "$WORK/runs/qs_$p" \
      --set "stages.two_stage.train.precision=$p" --set "stages.baseline.train.precision=$p"
  done
  step qs_graph_off 90 $PY -m pipeline run $qs --set run.device=$DEVICE --store "$STORE" \
    --output "$WORK/runs/qs_graph_off" --set stages.two_stage.train.cuda_graph=off
  # The same recipe on this machine's CPU: what the GPU's accuracy is compared with.
  step qs_cpu 120 "${cpu[@]}" $PY -m pipeline run $qs --set run.device=cpu --store "$WORK/store_cpu" \
    --output "$WORK/runs/qs_cpu"
  step memory_mobiletl 60 $PY -m pipeline memory recipes/mobiletl/digits.yaml --set run.device=$DEVICE --store "$STORE"
  step sweep 150 $PY -m pipeline sweep $qs --set run.device=$DEVICE --store "$STORE" --output "$WORK/runs/sweep" \
    --grid stages.two_stage.train.lr=0.003,0.01
  # The GPU-trained model on the CPU (no GPU visible): exported, evaluated on the recipe's test split,
  # and its classes compared with what the GPU run measured.
  step export_cpu 60 "${cpu[@]}" $PY -m pipeline export "$WORK/runs/qs_fp32" --stage two_stage
  step evaluate_cpu 60 "${cpu[@]}" $PY -m pipeline evaluate "$WORK/runs/qs_fp32" \
    "$WORK/runs/qs_fp32/recipe.resolved.yaml" --stage two_stage --set run.device=cpu --json
  step evaluate_cpu_pt2 60 "${cpu[@]}" $PY -m pipeline evaluate "$WORK/runs/qs_fp32/stages/two_stage/model.pt2" \
    "$WORK/runs/qs_fp32/recipe.resolved.yaml" --set run.device=cpu --json
  step predict_cpu_gpu 60 $PY -m benchmarks.gpu_predict_check "$WORK/runs/qs_fp32" two_stage
}

table4() {
  step table4_96px 170 $PY -m benchmarks.bench_fashion_table4 --device cuda --resolution 96 --seeds 0 1 \
    --store "$WORK/store_fm"
}

cache_reuse() {
  step cache_reuse 200 $PY -m benchmarks.bench_cache_reuse --device cuda --samples 2048 --epochs 4 \
    --batches 32 128 --cuts 1 4 7
}

codec() {
  step codec 60 $PY -m benchmarks.bench_codec_cuda --batches 32 128 1024 --repeats 50
}

neuroflux() {
  step neuroflux 150 $PY -m benchmarks.bench_neuroflux --device cuda --threads 16 --archs vgg11
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests smoke table4 cache_reuse codec neuroflux)
side_by_side=() one_by_one=()
for p in "${phases[@]}"; do
  case $p in
    tests|smoke|table4) side_by_side+=("$p") ;;
    cache_reuse|codec|neuroflux) one_by_one+=("$p") ;;
    *) echo "unknown phase: $p (expected tests smoke table4 cache_reuse codec neuroflux)"; exit 2 ;;
  esac
done
: > "$WORK/steps.txt"
for p in "${side_by_side[@]}"; do "$p" & done
wait
for p in "${one_by_one[@]}"; do "$p"; done
cpu_run=()
[ -f "$WORK/runs/qs_cpu/summary.json" ] && cpu_run=(--cpu-run "$WORK/runs/qs_cpu")
$PY -m benchmarks.gpu_check_report "$WORK" "${cpu_run[@]}" > "$WORK/logs/report.log" 2>&1
pack
echo "done: $(wc -l < "$WORK/steps.txt") steps; failed: $(grep -vc ' rc=0 ' "$WORK/steps.txt")"
