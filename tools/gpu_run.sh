#!/usr/bin/env bash
# GPU benchmarks: ONE prepared command, at most BUDGET_S (7 minutes) on one H200, 8 with every margin. Results
# go to $OUT (default /tmp/bench-gpu), three files: results.jsonl gets each result's JSON line as soon as it is
# printed (only JSON object lines, job/bench/jsonl.py), summary.txt one line per step, and at the end
# logs.tar.gz the logs ($OUT/logs/NAME.log while it runs) and the runs' TensorBoard events. Data, checkpoints
# and temporary files go to a scratch directory that is removed. It refuses without a CUDA GPU.
#   bash tools/gpu_run.sh
# 1. scaling: ResNet-50 bf16 channels_last, eager at batch 128,256,512, then compiled once (static shape) at 512,
#    images/s + MFU; it starts no measurement that would end past its own budget                       (<= 150 s)
# 2. data: the trainer on synthetic data vs decoded JPEGs, decoded by 8 workers (data.decode=cpu) and on the
#    GPU (data.decode=gpu, decoded ahead in a thread), img/s and each over synthetic (goal >= 0.95 with gpu)
#                                                                                                     (<= 3.5 min)
# 3. crops: the GPU decode path's batched crop vs torchvision's per-image kernels and roi_align, pixels and
#    ms per batch; nvJPEG vs libjpeg-turbo pixels                                                    (<= 40 s)
# 4. overhead: ddp-job's loop vs the bare DDP step alternating in one process (bench paired), then ddp-job
#    train vs a bare DDP loop (vs Lightning if installed), 1 GPU, ResNet-50 bf16 CL            (<= 50 s + 80 s)
# 5. strategy: the trainer on synthetic data with train.strategy=dp (nn.DataParallel), then fsdp (one unit
#    per Bottleneck block), against step 2's DDP run of the same settings: img/s, step time and peak
#    memory (max_memory_allocated) each                                                         (<= 50 s + 50 s)
# Steps 1, 2, 4 and 5 hold the figures asked for; crops (3) runs last, so a tight budget drops it first.
# Every command runs under a timeout cut to what is left of BUDGET_S, and is skipped when less than MIN_S is
# left, so every command has ended within BUDGET_S + KILL_S whatever hangs (summary.txt: "NAME rc=RC ended after
# N s"); after each, its log's follower gets at most FOLLOW_S to copy the last result lines. GPU_RUN_BUDGET_S
# overrides the budget (tests/test_benchmarks.py dry-runs the script on a CPU with a small one).
# Python: the project's venv with the CUDA build of torch (.venv, or PYTHON=...), else python3. A GPU image's
# python3 that holds torch but not the pydantic-settings stack gets it from wheels: tools/gpu_wheels.sh saves
# them to .whl where PyPI is reachable, and this script installs what it finds there (WHEELS=DIR) into the
# scratch directory; the repository itself goes on PYTHONPATH, so nothing needs installing on the machine.
# Kept separate from tools/gpu_check_efficiency.sh, same conventions ($OUT, TMPDIR, timeouts).
set -u
start=$(date +%s)
BUDGET_S=420
BUDGET_S=${GPU_RUN_BUDGET_S:-$BUDGET_S}
MIN_S=5   # a command needs at least this many seconds of budget, or it is skipped
KILL_S=5  # SIGKILL this long after a timeout's SIGTERM
FOLLOW_S=20  # the most a log's follower may take to copy its last result lines after the command ended
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/bench-gpu}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_run.sh: no CUDA GPU visible (torch.cuda.is_available() is False): these benchmarks measure the GPU." >&2
  echo "Fix: run it on the GPU machine; on CPU use 'ddp-job bench NAME' (docs/benchmarks.md)." >&2
  exit 2
fi
mkdir -p "$OUT/logs"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-run.XXXXXX")
export TMPDIR="$SCRATCH/tmp"
mkdir -p "$TMPDIR"
: > "$OUT/results.jsonl"
: > "$OUT/summary.txt"
finish() {  # the logs and TensorBoard events in one file; nothing of the scratch directory stays
  tar -czf "$OUT/logs.tar.gz" --exclude 'step-*' -C "$OUT" logs -C "$SCRATCH" runs 2>/dev/null \
    || tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs
  rm -rf "$OUT/logs" "$SCRATCH"
}
trap finish EXIT
WHEELS=${WHEELS:-.whl}
site=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SCRATCH/site" "$WHEELS"/*.whl || exit 2
  site=":$SCRATCH/site"
fi
export PYTHONPATH="$PWD$site${PYTHONPATH:+:$PYTHONPATH}"  # the project from this checkout, installed or not
if ! missing=$("$PY" -c 'import job.cli, job.bench.common, pydantic_settings' 2>&1); then
  echo "gpu_run.sh: $PY cannot import the project: ${missing##*$'\n'}" >&2
  echo "Fix: bash tools/gpu_wheels.sh where PyPI is reachable, and bring .whl along (or PYTHON=a venv with it)." >&2
  exit 2
fi

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
lim() {  # lim SECONDS: SECONDS, or what is left of BUDGET_S if fewer; fails when fewer than MIN_S are left
  local t=$1 left=$(( start + BUDGET_S - $(date +%s) ))
  (( left < t )) && t=$left
  (( t >= MIN_S )) || return 1
  echo "$t"
}
# run NAME SECONDS COMMAND...: COMMAND under the cut timeout, its output to $OUT/logs/NAME.log (a file: a child
# that outlives it cannot hold the script up), its JSON object lines to results.jsonl as they are printed
run() {
  local name=$1 t rc ended log="$OUT/logs/$1.log"
  if ! t=$(lim "$2"); then
    note "$name skipped: the budget of $BUDGET_S s is spent after $(( $(date +%s) - start )) s"
    return 1
  fi
  shift 2
  rm -f "$log" "$log.done"
  "$PY" -m job.bench.jsonl "$log" "$log.done" >> "$OUT/results.jsonl" &
  local follower=$!
  timeout -k "$KILL_S" "$t" "$@" > "$log" 2>&1
  rc=$?
  # The command's end, on the budget's clock; the follower's last copy after it is not the command's time.
  ended=$(( $(date +%s) - start ))
  touch "$log.done"
  local tenths=0
  while kill -0 "$follower" 2>/dev/null && (( tenths < FOLLOW_S * 10 )); do
    sleep 0.1
    tenths=$(( tenths + 1 ))
  done
  kill "$follower" 2>/dev/null
  wait "$follower"
  rm -f "$log.done"
  note "$name rc=$rc ended after $ended s"
  return "$rc"
}
bench() {  # bench NAME SECONDS ARGS...: python -m job.bench.NAME ARGS
  local name=$1 t=$2
  shift 2
  run "$name" "$t" "$PY" -m "job.bench.$name" "$@"
}

# shellcheck disable=SC2016  # "$0" is the inner bash's: the interpreter passed after the script
run env 30 bash -c 'date -u; nvidia-smi; "$0" -c "import json, torch, torchvision; print(json.dumps(dict(benchmark=\"env\", torch=torch.__version__, torchvision=torchvision.__version__, gpu=torch.cuda.get_device_name())))"' "$PY"
# train NAME SECONDS ARGS...: the trainer as run "data-NAME" (ResNet-50 bf16 channels_last, 224 px, batch 256,
# 30 steps, no checkpoints) with ARGS added, then its img/s after 10 steps of warm-up (job.bench.decode)
train() {
  local name=$1 t=$2
  shift 2
  run "data-$name" "$t" "$PY" -m job train --run.output-dir "$SCRATCH/runs" --run.name "data-$name" \
    --data.num-classes 10 --data.image-size 224 --data.num-workers 8 --model.name resnet50 \
    --model.channels-last true --train.precision bf16 --train.steps 30 --train.global-batch-size 256 \
    --ckpt.every 0 --log.every 5 --log.progress off "$@" \
    && run "decode-$name" 20 "$PY" -m job.bench.decode "$SCRATCH/runs" 10 "$name"
}

bench scaling 150 --batches 128,256,512 --compile both --compile-batches 512 --steps 20 --budget-s 140
# data: synthetic vs decoded real data through the trainer (JPEG 256 px -> 224 px crops), both decode paths
train synthetic 50 --data.source synthetic
# 5,200 training images: 20.3 steps of 256 per epoch, so one of the four 5-step windows after the warm-up holds
# an epoch boundary (the decode-ahead thread restarts there) and their median does not
if run make_data 50 "$PY" -m job make-data --out "$SCRATCH/data" --classes 10 --per-class 520 --val-per-class 10 \
  --size 256 --format jpeg; then
  train cpu 50 --data.path "$SCRATCH/data" --data.decode cpu
  train gpu 50 --data.path "$SCRATCH/data" --data.decode gpu
fi
# strategy: nn.DataParallel, then FSDP, against the DDP of the synthetic run above, the same settings otherwise
train dp 50 --data.source synthetic --train.strategy dp
train fsdp 50 --data.source synthetic --train.strategy fsdp --fsdp.units '[Bottleneck]'
bench decode 20 "$SCRATCH/runs" 10
bench paired 50 --nprocs 1 --reps 1 --pairs 60 --warmup 10 --model resnet50 --image-size 224 --batch 256 \
  --precision bf16 --channels-last --bare-bucket-view
bench overhead 80 --nprocs 1 --reps 1 --steps 50 --warmup 15 --log-every 5 --model resnet50 --image-size 224 \
  --batch 256 --precision bf16 --channels-last --lightning auto
bench crops 40 --device cuda --batch 256 --size 224
grep -h "samples/s" "$OUT"/logs/data-*.log 2>/dev/null | tail -8 >> "$OUT/summary.txt"
note "done after $(( $(date +%s) - start )) s (budget $BUDGET_S s)"
cat "$OUT/summary.txt" "$OUT/results.jsonl"
