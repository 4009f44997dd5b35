#!/usr/bin/env bash
# Efficiency-options GPU check: ONE command, at most ~7.5 minutes on one H200. Results go to $OUT (default /tmp/efficiency-gpu).
#   bash tools/gpu_check_efficiency.sh
# 1. tools/gpu_efficiency.py: ResNet-50 images/s for fp32 / fp32+tf32 / bf16 / bf16+channels_last /
#    +compile, each with and without the side-stream prefetch; no wrapper vs DDP vs DataParallel on one GPU.
# 2. The job itself on the GPU: train.strategy=dp runs; ZeRO + bf16 comm hook + EMA + device prefetch on
#    an ImageFolder (pinned host batches) with NCCL, checkpoint and all.
# Needs the project's venv with the CUDA build of torch (.venv, or PYTHON=...); the machine has no network.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/efficiency-gpu}
mkdir -p "$OUT/tmp"
export TMPDIR="$OUT/tmp"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
start=$(date +%s)
{ nvidia-smi; "$PY" -c 'import torch, torchvision, timm; print(torch.__version__, torchvision.__version__, timm.__version__, torch.cuda.is_available())'; } > "$OUT/env.txt" 2>&1

timeout 300 "$PY" tools/gpu_efficiency.py --out "$OUT/efficiency_gpu.json" --budget-s 230 > "$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"

timeout 70 "$PY" -m job train --run.output-dir "$OUT/runs" --run.name dp --data.source synthetic \
  --data.image-size 64 --data.num-classes 10 --model.name resnet50 --train.strategy dp --train.steps 20 \
  --train.global-batch-size 128 --train.precision bf16 --model.channels-last true --log.every 5 \
  --log.progress off > "$OUT/job_dp.log" 2>&1
echo "job dp rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"

"$PY" -m job make-data --out "$OUT/data" --classes 10 --per-class 64 --size 64 > /dev/null 2>&1
timeout 70 "$PY" -m job train --run.output-dir "$OUT/runs" --run.name zero-bf16hook --data.path "$OUT/data" \
  --data.num-classes 10 --data.image-size 64 --data.num-workers 4 --model.name resnet18 --train.steps 20 \
  --train.global-batch-size 64 --train.micro-batch-size 32 --optim.name adamw --optim.lr 0.001 --optim.zero true \
  --ddp.comm-hook bf16 --ddp.comm-stats true --ema.enabled true --train.precision bf16 --train.tf32 true \
  --data.device-prefetch true --ckpt.every 10 --log.every 5 --log.progress off > "$OUT/job_zero.log" 2>&1
echo "job zero rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep -h "FINAL\|EMA\|comm:\|samples/s" "$OUT"/job_*.log | tail -20 >> "$OUT/summary.txt"
rm -rf "$OUT/tmp" "$OUT/data" "$OUT/runs"/*/step-*  # keep logs and configs, not checkpoints
cat "$OUT/summary.txt"
