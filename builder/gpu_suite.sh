#!/usr/bin/env bash
# One device call: kernel checks at real shapes, the bundled model on the CUDA serving path, then the
# Llama-3-8B-shaped bf16 benchmarks. Results go to $OUT (or ./gpu-results). Usage:
#   bash builder/gpu_suite.sh [kernels|smoke|8b|8b-fp8|hf|hf-compile]...   (default: kernels smoke 8b)
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
parts=${*:-kernels smoke 8b}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
for part in $parts; do
  case $part in
    kernels)
      python3 -m kernels.bench_attention 2>&1 | tee "$OUT/bench_attention.txt"
      python3 -m kernels.bench_gemm 2>&1 | tee "$OUT/bench_gemm.txt" ;;
    smoke)
      python3 -m builder.cuda_smoke artifacts/quickstart artifacts/quickstart-gptq artifacts/quickstart-fp8 \
        2>&1 | grep -v Warning | tee "$OUT/cuda_smoke.txt" ;;
    8b)
      t0=$(date +%s)
      python3 -m builder.make_checkpoint --preset llama3-8b --out checkpoints/llama3-8b-random 2>&1 | tail -1
      python3 -m builder.cli build recipes/bench/llama3-8b-bf16.yaml --quiet 2>&1 | tail -3
      echo "checkpoint + build: $(( $(date +%s) - t0 )) s"
      python3 -m builder.cli bench latency artifacts/llama3-8b-bf16 --input-len 128 --input-len 2048 \
        --output-len 128 --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{'
      python3 -m builder.cli bench throughput artifacts/llama3-8b-bf16 --input-len 128 --output-len 128 \
        --concurrency 16 --concurrency 64 --concurrency 256 --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{' ;;
    8b-fp8)
      [ -d checkpoints/llama3-8b-random ] || python3 -m builder.make_checkpoint --preset llama3-8b --out checkpoints/llama3-8b-random 2>&1 | tail -1
      t0=$(date +%s)
      python3 -m builder.cli build recipes/bench/llama3-8b-fp8.yaml --quiet 2>&1 | tail -3
      echo "fp8 build: $(( $(date +%s) - t0 )) s"
      python3 -m builder.check_kernels artifacts/llama3-8b-fp8 2>&1 | tail -1 | tee -a "$OUT/bench_8b.jsonl"
      python3 -m builder.cli bench latency artifacts/llama3-8b-fp8 --input-len 128 --input-len 2048 \
        --output-len 128 --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{'
      python3 -m builder.cli bench throughput artifacts/llama3-8b-fp8 --input-len 128 --output-len 128 \
        --concurrency 64 --concurrency 256 --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{'
      python3 -m builder.cli bench throughput artifacts/llama3-8b-fp8 --input-len 2048 --output-len 128 \
        --concurrency 32 --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{' ;;
    hf|hf-compile)
      [ -d checkpoints/llama3-8b-random ] || python3 -m builder.make_checkpoint --preset llama3-8b --out checkpoints/llama3-8b-random
      [ "$part" = hf ] && python3 -m builder.bench_hf checkpoints/llama3-8b-random 2>&1 | grep '^{' | tee -a "$OUT/bench_8b.jsonl"
      python3 -m builder.bench_hf checkpoints/llama3-8b-random --compile > "$OUT/hf_compile.log" 2>&1
      grep '^{' "$OUT/hf_compile.log" | tee -a "$OUT/bench_8b.jsonl" || tail -n 20 "$OUT/hf_compile.log" ;;
  esac
done
