#!/usr/bin/env bash
# What a CUDA machine runs to check stream and to measure the figures of bench/RESULTS.md (see bench/README.md).
#
#   bash bench/gpu_host.sh check     the GPU, the driver and the packages stream uses on it
#   bash bench/gpu_host.sh export    the RetinaNet-v2 models (random weights, 800x800) and the 1080p sample video
#   bash bench/gpu_host.sh test      the GPU tests
#   bash bench/gpu_host.sh bench     ours against the naive loop: bench/postprocess.py (8 streams), bench/throughput.py
#   bash bench/gpu_host.sh sweep     streams and buffers: bench/streams.py
#   bash bench/gpu_host.sh latency   live feeds, capture to subscriber: bench/latency.py (paced 1080p30 feeds)
#   bash bench/gpu_host.sh workers   live feeds read by threads against decode worker processes (A/B), 8 to 32
#                                    feeds, then 48 feeds at detect_fps 8
#   bash bench/gpu_host.sh mps       the same A/B with CUDA's MPS control daemon running for this bench only (its
#                                    pipe and log folders private to it, quit at the end)
#   bash bench/gpu_host.sh soak      files and a live feed for MINUTES (default 10) with faults injected: bench/soak.py
#   bash bench/gpu_host.sh providers the CUDA provider options one at a time: inference rate and the device memory
#                                    the engine holds (bench/postprocess.py --sweep-only)
#   bash bench/gpu_host.sh all       check, export, test, bench
#
# Logs and JSON go to $OUT (default /tmp/out); models to /tmp/models, the video to /tmp/hd.mp4. Packages: the
# repository installed with `pip install -e '.[gpu,export,test,bench]'` (or '.[cuda12,...]'), or, on a host
# without network, the same wheels installed into /tmp/site, which is put on PYTHONPATH here.
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODELS=/tmp/models
VIDEO=/tmp/hd.mp4
mkdir -p "$OUT" "$MODELS"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
what=${1:-all}
# Random weights: at 0.05 the full model keeps its detection maximum on every content frame; at 0.12 the
# number of detections varies from frame to frame (0 on dark frames, up to ~60) on the sample video.
THRESH=${THRESH:-0.12}

check() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  python3 - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import sys
import av, cupy, nvidia.dali as dali, onnxruntime as ort, zmq
print("python", sys.version.split()[0], "ort", ort.__version__, ort.get_available_providers())
print("dali", dali.__version__, "cupy", cupy.__version__, "av", av.__version__, "zmq", zmq.__version__)
try:
    import torch, torchvision
    print("torch", torch.__version__, "torchvision", torchvision.__version__)
except ImportError:
    print("torch: not installed (needed by `export` only)")
from stream.engines.device import cuda_unavailable_reason
print("cuda path:", cuda_unavailable_reason() or "usable")
EOF
}

export_one() {
  # one model, unless it is there: $1 graph|device (post-processing), $2 batch, $3 fp32|fp16;
  # graph -> $MODELS/r50_b<batch>_<prec>.onnx, device -> $MODELS/r50_head_<prec>.onnx (dynamic batch)
  local f extra=""
  if [ "$1" = graph ]; then f=$MODELS/r50_b$2_$3.onnx; else f=$MODELS/r50_head_$3.onnx; fi
  [ -f "$f" ] && return 0
  [ "$3" = fp16 ] && extra="--fp16"
  python3 -m stream export-model --arch retinanet_resnet50_fpn_v2 --weights random --input-size 800 800 \
    --batch "$2" $extra --score-thresh "$THRESH" --postprocess "$1" --output "$f" > "$f.log" 2>&1
  tail -2 "$f.log"
}

video() {
  [ -f "$VIDEO" ] || python3 -m stream sample --output "$VIDEO" --size 1920 1080 --seconds 16
}

export_models() {
  # graph post-processing at batch 1 and 8, fp32 and fp16 (batch 1 fp32 is the naive loop's model), and device
  # post-processing (`--postprocess device`, dynamic batch) in fp32 and fp16; in parallel, about a minute
  for spec in "graph 1 fp32" "graph 8 fp32" "graph 1 fp16" "graph 8 fp16" "device 8 fp32" "device 8 fp16"; do
    export_one $spec &
  done
  video &
  wait
  ls -la "$MODELS" | tee "$OUT/models.txt"
}

need() {
  # the models a target uses, exported if missing: "graph 1 fp32" "device 8 fp16" ...
  for spec in "$@"; do export_one $spec & done
  video &
  wait
}

gpu_tests() {
  need "device 8 fp32" "device 8 fp16"  # tests/gpu/test_gpu_postprocess.py takes them from $STREAM_TEST_MODELS
  local rc
  local pick=()
  [ -n "${GPU_K:-}" ] && pick=(-k "$GPU_K")
  # GPU_TESTS: other test paths than the whole GPU suite; GPU_K: pytest's -k
  STREAM_TEST_MODELS=$MODELS timeout "${TEST_TIMEOUT:-580}" python3 -m pytest -q -s -p no:cacheprovider -rs -m gpu \
    ${GPU_TESTS:-tests/gpu tests/sources/test_nvdec.py tests/daemon/test_workers.py} "${pick[@]}" > "$OUT/pytest-gpu.txt" 2>&1
  rc=$?
  # the time limit's SIGTERM reaches pytest, where a test's in-process daemon may take it as its stop signal: that
  # test fails (its run stopped early) and the ones after it still run; say so beside the counts
  [ $rc = 124 ] && echo "TEST_TIMEOUT (${TEST_TIMEOUT:-580} s) ran out: the test under way then failed on that" \
    "stop, not on its own" | tee -a "$OUT/pytest-gpu.txt"
  grep -E "passed|failed|^FAILED|^ERROR|TEST_TIMEOUT" "$OUT/pytest-gpu.txt" | tail -20
  return $rc
}

bench() {
  # the headline: 8 file streams through the daemon's pipeline, device post-processing batch 8 fp16 (with the
  # other cuda_graph setting beside it) and batch 1, graph post-processing batch 1 fp32, and the naive loop,
  # all in one run; then one stream through the pipeline against the naive loop (bench/throughput.py)
  need "graph 1 fp32" "device 8 fp16"
  mkdir -p /tmp/models-bench && ln -sf "$MODELS/r50_head_fp16.onnx" "$MODELS/r50_b1_fp32.onnx" /tmp/models-bench/
  timeout 300 python3 bench/postprocess.py --device cuda --models /tmp/models-bench --video "$VIDEO" --streams 8 \
    --seconds 4 --infer-seconds 2 --ceiling-batches 6 --compare-cuda-graph --json "$OUT/postprocess-cuda.json" 2>&1 \
    | grep -v "W:onnx" > "$OUT/postprocess-cuda.txt"
  tail -11 "$OUT/postprocess-cuda.txt"
  timeout 200 python3 bench/throughput.py --device cuda --model "$MODELS/r50_head_fp16.onnx" \
    --naive-model "$MODELS/r50_b1_fp32.onnx" --video "$VIDEO" --naive-frames 120 \
    --json "$OUT/throughput-cuda.json" 2>&1 | grep -v "W:onnx" | tee "$OUT/throughput-cuda.txt" | tail -4
}

sweep() {
  # frames a second against the number of file streams and of inference buffers, beside the engine's
  # inference-only ceiling (the PNG needs matplotlib, the 'bench' extra)
  need "device 8 fp16"
  timeout 580 python3 bench/streams.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
    --streams 1 4 8 16 32 --buffers 1 2 3 --buffers-streams 8 --seconds 4 --infer-seconds 2 \
    --json "$OUT/streams-cuda.json" --plot "$OUT/streams-cuda.png" 2>&1 | grep -v "W:onnx" > "$OUT/streams-cuda.txt"
  tail -16 "$OUT/streams-cuda.txt"
}

latency() {
  # capture-to-subscriber latency of 1, 8 and 16 paced 1080p30 feeds (the bench paces the file: a CUDA host
  # seldom has GStreamer's RTSP server)
  need "device 8 fp16"
  timeout 580 python3 bench/latency.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
    --modes paced --feeds 1 8 16 --seconds 10 --warmup 3 --json "$OUT/latency-cuda.json" \
    --plot "$OUT/latency-cuda.png" 2>&1 | grep -v "W:onnx" > "$OUT/latency-cuda.txt"
  grep -E "^paced|^\| paced" "$OUT/latency-cuda.txt"
}

workers() {
  # the live-feed A/B: today's reader threads against decode worker processes (live_workers auto), paced
  # 1080p30 feeds, one run; then 48 feeds at detect_fps 8 (384 of 1,440 decoded frames a second to the model)
  need "device 8 fp16"
  timeout 400 python3 bench/latency.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
    --modes paced --feeds 8 16 24 32 --seconds 8 --warmup 3 --live-workers 0 auto \
    --json "$OUT/workers-cuda.json" 2>&1 | grep -v "W:onnx" > "$OUT/workers-cuda.txt"
  grep -E "^\| paced" "$OUT/workers-cuda.txt"
  timeout 180 python3 bench/latency.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
    --modes paced --feeds 48 --seconds 8 --warmup 3 --live-workers auto --set detect_fps=8 \
    --json "$OUT/workers-48-cuda.json" 2>&1 | grep -v "W:onnx" > "$OUT/workers-48-cuda.txt"
  grep -E "^\| paced" "$OUT/workers-48-cuda.txt"
}

mps() {
  # decode processes share the GPU with the engine through one MPS server instead of time-sliced contexts.
  # The daemon is this bench's own: private pipe and log folders (only processes given them use it), quit
  # at the end; the GPU's compute mode and other settings are left as they are. MPS_FEEDS, MPS_WORKERS: the
  # points; MPS_SET=KEY=VALUE: a config override for every point (outputs named mps-KEY-VALUE-*); MPS_48=0:
  # without the 48-feed point; MPS_ARGS: more arguments to bench/latency.py (e.g. "--lanes newest fifo"); MPS_48_ARGS:
  # the same for the 48-feed point (e.g. "--vary take_ahead_ms=0,6").
  command -v nvidia-cuda-mps-control > /dev/null || { echo "nvidia-cuda-mps-control: not on this host" | tee "$OUT/mps.txt"; return 1; }
  need "device 8 fp16"
  local tag="" set=()
  if [ -n "${MPS_SET:-}" ]; then tag="-${MPS_SET//=/-}"; set=(--set "$MPS_SET"); fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/stream-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/stream-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start" | tee "$OUT/mps.txt"; return 1; }
  timeout 400 python3 bench/latency.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
    --modes paced --feeds ${MPS_FEEDS:-16 24 32} --seconds 8 --warmup 3 --live-workers ${MPS_WORKERS:-auto 0} \
    "${set[@]}" ${MPS_ARGS:-} --json "$OUT/mps$tag-cuda.json" 2>&1 | grep -v "W:onnx" > "$OUT/mps$tag-cuda.txt"
  grep -E "^\| paced" "$OUT/mps$tag-cuda.txt"
  if [ "${MPS_48:-1}" = 1 ]; then
    timeout 180 python3 bench/latency.py --device cuda --model "$MODELS/r50_head_fp16.onnx" --video "$VIDEO" \
      --modes paced --feeds 48 --seconds 8 --warmup 3 --live-workers auto --set detect_fps=8 "${set[@]}" \
      ${MPS_48_ARGS:-} --json "$OUT/mps$tag-48-cuda.json" 2>&1 | grep -v "W:onnx" > "$OUT/mps$tag-48-cuda.txt"
    grep -E "^\| paced" "$OUT/mps$tag-48-cuda.txt"
  fi
  echo get_server_list | nvidia-cuda-mps-control > "$OUT/mps-servers.txt" 2>&1
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

soak() {
  # 4 looped 1080p files and a paced live feed for MINUTES, faults injected; the daemon's log (with SIGUSR1
  # stack dumps) comes back beside the table
  need "device 8 fp16"
  local minutes=${MINUTES:-10}
  timeout $(( minutes * 60 + 240 )) python3 bench/soak.py --minutes "$minutes" --files 4 --live 1 --live-kind paced \
    --device cuda --model "$MODELS/r50_head_fp16.onnx" --size 1920 1080 --no-annotate --stacks 4 \
    --daemon-log "$OUT/soak-daemon.log" --json "$OUT/soak-cuda.json" 2>&1 | tee "$OUT/soak-cuda.txt" | tail -45
}

providers() {
  # what each CUDA provider option costs in rate and in device memory (the engine's sessions, warmed up)
  need "device 8 fp32" "device 8 fp16"
  timeout 400 python3 bench/postprocess.py --device cuda --models "$MODELS" --video "$VIDEO" --sweep-only \
    --infer-seconds 2 --ceiling-batches 6 --json "$OUT/providers-cuda.json" 2>&1 | grep -v "W:onnx" \
    > "$OUT/providers-cuda.txt"
  grep "provider options" "$OUT/providers-cuda.txt"
}

case $what in
  check) check ;;
  export) export_models ;;
  test) gpu_tests ;;
  bench) bench ;;
  sweep) sweep ;;
  latency) latency ;;
  workers) workers ;;
  mps) mps ;;
  soak) soak ;;
  providers) providers ;;
  all) check; export_models; gpu_tests; bench ;;
  *) echo "usage: bash bench/gpu_host.sh check|export|test|bench|sweep|latency|workers|mps|soak|providers|all" >&2; exit 2 ;;
esac
