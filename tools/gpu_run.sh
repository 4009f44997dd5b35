#!/usr/bin/env bash
# GPU benchmarks: ONE prepared command, at most ~8 minutes on one H200. Results (JSON lines + logs)
# go to $OUT (default /tmp/bench-gpu); it refuses on a machine without a CUDA GPU.
#   bash tools/gpu_run.sh
# 1. scaling: ResNet-50 bf16 channels_last, compile off/on, batch 128,256,512, images/s + MFU (<= 160 s)
# 2. overhead: ddp-job train vs bare DDP loop (vs Lightning if installed), 1 GPU, ResNet-50 bf16 CL (<= 80 s)
#    and the same alternating step by step in one process (bench paired, <= 60 s)
# 3. data: the trainer on synthetic data vs decoded JPEGs, decoded by 8 workers (data.decode=cpu) and on the
#    GPU (data.decode=gpu), img/s and each over synthetic (goal >= 0.95 with gpu)                    (~2.5 min)
# Needs the project's venv with the CUDA build of torch (.venv, or PYTHON=...); the machine has no network.
# Kept separate from tools/gpu_check_efficiency.sh, same conventions ($OUT, TMPDIR, timeouts).
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/bench-gpu}
mkdir -p "$OUT/tmp"
export TMPDIR="$OUT/tmp"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_run.sh: no CUDA GPU visible (torch.cuda.is_available() is False): these benchmarks measure the GPU." >&2
  echo "Fix: run it on the GPU machine; on CPU use 'ddp-job bench NAME' (docs/benchmarks.md)." >&2
  exit 2
fi
start=$(date +%s)
BUDGET_S=470  # the whole script, all steps together: every command's timeout is cut to what is left
lim() {  # lim SECONDS: SECONDS, or the seconds left of BUDGET_S if fewer (at least 1)
  local t=$1 left=$(( start + BUDGET_S - $(date +%s) ))
  (( left < t )) && t=$left
  (( t < 1 )) && t=1
  echo "$t"
}
{ date -u; timeout 20 nvidia-smi; timeout 60 "$PY" -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__)'; } > "$OUT/env.txt" 2>&1
step() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$(lim "$t")" "$PY" -m "job.bench.$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n 1 "$OUT/$name.log" >> "$OUT/results.jsonl"
}
step scaling 160 --batches 128,256,512 --compile both --steps 20
step overhead 80 --nprocs 1 --reps 1 --steps 50 --warmup 15 --log-every 5 --model resnet50 --image-size 224 \
  --batch 256 --precision bf16 --channels-last --lightning auto
step paired 60 --nprocs 1 --reps 1 --pairs 60 --warmup 10 --model resnet50 --image-size 224 --batch 256 \
  --precision bf16 --channels-last --bare-bucket-view
# data: synthetic vs decoded real data through the trainer (JPEG 256 px -> 224 px crops), both decode paths
timeout "$(lim 60)" "$PY" -m job make-data --out "$OUT/data" --classes 10 --per-class 300 --size 256 --format jpeg > "$OUT/make_data.log" 2>&1
for run in synthetic:synthetic:cpu imagefolder:cpu:cpu imagefolder:gpu:gpu; do
  IFS=: read -r src decode name <<< "$run"
  timeout "$(lim 50)" "$PY" -m job train --run.output-dir "$OUT/runs" --run.name "data-$name" --data.source "$src" \
    --data.decode "$decode" --data.path "$OUT/data" --data.num-classes 10 --data.image-size 224 \
    --data.num-workers 8 --model.name resnet50 --model.channels-last true --train.precision bf16 \
    --train.steps 30 --train.global-batch-size 256 --ckpt.every 0 --log.every 5 --log.progress off \
    > "$OUT/data-$name.log" 2>&1
  echo "data-$name rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
done
timeout "$(lim 20)" "$PY" -m job.bench.decode "$OUT/runs" 10 >> "$OUT/results.jsonl" 2>> "$OUT/summary.txt"
grep -h "samples/s" "$OUT"/data-*.log | tail -8 >> "$OUT/summary.txt"
rm -rf "$OUT/tmp" "$OUT/data" "$OUT/runs"/*/step-*  # keep logs, TensorBoard events and results, not checkpoints
cat "$OUT/summary.txt" "$OUT/results.jsonl"
