#!/usr/bin/env bash
# Everything the GPU host runs for this project, in one go, after the wheels are staged (see README, "GPU host").
#   bash bench/gpu_host.sh [check|export|test|bench|sweep|all]     (writes logs and JSON under $OUT; `all` skips sweep)
# The host has no network: torch/torchvision there export the models; onnxruntime-gpu, DALI, PyAV and pyzmq
# come from ../shared/gpu/wheelhouse.sh, installed into /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/models
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
what=${1:-all}
# Random weights: at 0.05 the full model keeps its detection maximum on every content frame; at 0.12 the
# count varies (0 on dark frames, up to ~60) on the sample video (measured on the host, torch 2.11, seed 0).
THRESH=${THRESH:-0.12}

check() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  python3 - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import onnxruntime as ort, cupy, av, zmq, nvidia.dali as dali, torch, torchvision, sys
print("python", sys.version.split()[0], "ort", ort.__version__, ort.get_available_providers())
print("dali", dali.__version__, "cupy", cupy.__version__, "av", av.__version__, "zmq", zmq.__version__)
print("torch", torch.__version__, "torchvision", torchvision.__version__)
from stream.infer import cuda_unavailable_reason; print("cuda path:", cuda_unavailable_reason() or "usable")
EOF
}

export_models() {
  # The full model at 800x800: batch 1 for the naive loop, batch 8 (fp32 and fp16) for the pipeline.
  for spec in "1 fp32" "8 fp32" "8 fp16"; do
    set -- $spec
    f=/tmp/models/r50_b$1_$2.onnx
    [ -f "$f" ] && continue
    extra=""; [ "$2" = fp16 ] && extra="--fp16"
    /usr/bin/time -f "export b$1 $2: %e s" python3 -m stream export-model --arch retinanet_resnet50_fpn_v2 \
      --weights random --input-size 800 800 --batch "$1" $extra --score-thresh "$THRESH" --output "$f" 2>&1 | tail -3
  done
  ls -la /tmp/models
}

run_tests() {
  # the whole suite: the GPU tests and, on this machine too, the CPU ones
  python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest-all.txt" | tail -40
}

run_bench() {
  [ -f /tmp/hd.mp4 ] || python3 -m stream sample --output /tmp/hd.mp4 --size 1920 1080 --seconds 16
  python3 bench/throughput.py --device cuda --model /tmp/models/r50_b8_fp16.onnx --naive-model /tmp/models/r50_b1_fp32.onnx \
    --video /tmp/hd.mp4 --naive-frames 120 --buffers 2 --json "$OUT/bench-cuda-b8-fp16-2buf.json"
  python3 bench/throughput.py --device cuda --model /tmp/models/r50_b8_fp32.onnx --naive-model /tmp/models/r50_b1_fp32.onnx \
    --video /tmp/hd.mp4 --naive-frames 120 --buffers 2 --json "$OUT/bench-cuda-b8-fp32-2buf.json"
  python3 bench/throughput.py --device cuda --model /tmp/models/r50_b8_fp16.onnx --naive-model /tmp/models/r50_b1_fp32.onnx \
    --video /tmp/hd.mp4 --naive-frames 60 --buffers 1 --json "$OUT/bench-cuda-b8-fp16-1buf.json"
}

sweep() {
  # bench/streams.py (fps against streams and buffers, beside the inference-only ceiling) and bench/latency.py
  # (capture-to-publish latency of 1/4/8/16 live feeds: 1080p files paced at 30 fps by the bench, as the host has
  # no GStreamer RTSP server), about 4 minutes each. The PNGs need matplotlib (GPU_EXTRA in wheelhouse.sh);
  # without it the tables and JSON are still written.
  f=/tmp/models/r50_b8_fp16.onnx
  [ -f "$f" ] || python3 -m stream export-model --arch retinanet_resnet50_fpn_v2 --weights random --input-size 800 800 \
    --batch 8 --fp16 --score-thresh "$THRESH" --output "$f" 2>&1 | tail -3
  [ -f /tmp/hd.mp4 ] || python3 -m stream sample --output /tmp/hd.mp4 --size 1920 1080 --seconds 16
  timeout 300 python3 bench/streams.py --device cuda --model "$f" --video /tmp/hd.mp4 --streams 1 4 16 32 \
    --buffers 1 2 3 --buffers-streams 4 --sweep-buffers 2 --seconds 6 --infer-seconds 3 \
    --json "$OUT/streams-cuda.json" --plot "$OUT/streams-cuda.png" 2>&1 | tee "$OUT/streams-cuda.txt"
  timeout 300 python3 bench/latency.py --device cuda --model "$f" --video /tmp/hd.mp4 --modes paced \
    --feeds 1 4 8 16 --seconds 20 --warmup 4 \
    --json "$OUT/latency-cuda.json" --plot "$OUT/latency-cuda.png" 2>&1 | tee "$OUT/latency-cuda.txt"
}

case $what in
  check) check ;;
  export) export_models ;;
  test) run_tests ;;
  bench) run_bench ;;
  sweep) sweep ;;
  all) check; export_models; run_tests; run_bench ;;
esac
