#!/usr/bin/env bash
# GPU checks and benchmarks, in parts, for device calls. Results go to $OUT (or ./gpu-results). Usage:
#   bash builder/devtools/gpu_suite.sh PART...
# parts:
#   kernels        attention, W4A16 and W8A8 GEMM, elementwise kernels vs their references at real shapes, timed
#   w8a8-sweep     W8A8 FP8 config sweep (tuning _CUDA_CONFIGS)
#   w4a8           W4A8 (kernels.frag_mm.frag_mm_fp8): kernels.bench.gemm --w4a8 (against W4A16 frag_mm, FP8 W8A8 on
#                  cuBLAS and bf16 cuBLAS at the 8B shapes, configs swept; rows $W4A8_ROWS, default 128 256 512) into
#                  $OUT/bench_w4a8.txt, then tests/kernels/test_w4a8.py and test_frag_mm.py on the GPU
#   prefill-sweep  the prefill attention kernel's tilings (kernels.bench.attention --prefill-sweep: BLOCK_M x BLOCK_N
#                  x warps x stages over 2,048-token prompts, bf16 and fp8 caches; best-config lines for
#                  KERNELS_PREFILL_CONFIG) into $OUT/prefill_sweep.txt
#   own-kv-PREC    the prefill attention of fresh prompts over the step's own K/V (RUNTIME_PREFILL_OWN_KV): its tilings
#                  (kernels.bench.attention --prefill-sweep --sweep-kv bf16 --sweep-own-kv, in
#                  $OUT/prefill_own_kv_sweep.txt), then PREC's 2048/128 throughput at concurrency 64 and 2,048-token TTFT with it off and on
#                  ($OUT/own_kv_PREC.jsonl, tagged "own_kv")
#   silu-quant     the quantized SiLU-mul, one pass against two (kernels.bench.silu_quant: us and TB/s at 1-8192
#                  rows of 14336, each chunk of $SILU_CHUNKS, default "0 1024 2048 4096"), and the elementwise tests
#                  on the GPU (tests/kernels/test_elementwise.py with TRITON_INTERPRET=0)
#   moe            fused MoE (kernels/moe.py): its tests compiled on the GPU (tests/kernels/test_moe_kernel.py: small
#                  shapes, Qwen3-30B-A3B and Mixtral-8x7B layers, a CUDA graph over changing routings;
#                  tests/runtime/test_executor_moe.py: a tiny MoE artifact served from CUDA graphs vs the CPU path),
#                  then `python -m kernels.bench.moe` (fused vs torch op, T = 1 ... 1024) in $OUT/bench_moe.txt;
#                  MOE_SWEEP=1 also times candidate configs at T = 1, 64, 1024 (tuning kernels/moe.py _CUDA_CONFIGS)
#   moe-e2e[-PREC] Qwen3-30B-A3B shape (recipes/bench/qwen3-30b-a3b-PREC.yaml, PREC bf16 by default, fp8, or
#                  fp8blocks: a checkpoint pre-quantized as Qwen3-30B-A3B-FP8 is, made with --fp8-blocks 128) end to
#                  end in one call, about 6 minutes on an H100 (run it alone or first: its checkpoint takes 57 of the
#                  disk's 64 GiB): the random checkpoint on the GPU into checkpoints/qwen3-30b-a3b-random (kept if
#                  there), the build into /dev/shm (RAM: the disk cannot hold a second 57 GiB), batch-1 latency and
#                  128/128 throughput at concurrency 64 and 128; figures in $OUT/benchmarks.jsonl (decode_b1_moe_PREC,
#                  ttft_128_moe_PREC, throughput_128_128_moe_PREC[_cC]), each phase's seconds in $OUT/moe_e2e.jsonl,
#                  logs in $OUT/moe_*_PREC.log. MOE_LAYERS=N builds N of the 48 layers (a dry run: paths get -LN,
#                  figures go to $OUT/moe_dry_run_LN.jsonl instead)
#   70b-fp8        (issue 22; the 2-GPU kind: 256 GB of RAM, 128 GB of disk) the Llama-3-70B shape pre-quantized as
#                  compressed-tensors FP8 (make_checkpoint --preset llama3-70b --fp8-channel, 72 GB, into /dev/shm; kept
#                  if there), built at tp_size $TP70 (default 1) into artifacts/llama3-70b-fp8-tpN (one such artifact on
#                  the disk at a time), then batch-1 latency and 128/128 throughput ($THROUGHPUT70, default
#                  "--concurrency 64 --concurrency 128 --concurrency 256"); figures renamed for the model and the ranks
#                  into $OUT/benchmarks.jsonl: tpN_decode_b1_fp8_70b, tpN_roofline_pct_b1_70b (the bench's own roofline
#                  of the bytes a step reads), tpN_throughput_128_128_fp8_70b[_cC], ...; phases' seconds printed
#   moe-prequant-smoke  block-FP8 experts on the GPU: tests/kernels/test_moe_kernel.py -k block_fp8 (real shapes
#                  too), then the tiny-moe preset written as fine-grained FP8 (make_checkpoint --fp8-blocks 32), built
#                  and run by builder.devtools.cuda_smoke (CUDA greedy tokens vs the CPU path), in each dtype of
#                  $SMOKE_DTYPES (default "bfloat16 float32": in fp32 the two paths round the same inputs to FP8, so
#                  their tokens can be compared closely; in bf16 activations rounded differently flip FP8 codes)
#   families       the elementwise kernels' tests (RMSNorm, LayerNorm, RoPE with partial and interleaved rotary, ...)
#                  and the executor's kernel path on the LayerNorm / partial-rotary / soft-cap / sinks families
#                  (tests/runtime/test_executor_families.py: tiny models served on CUDA from CUDA graphs against the
#                  CPU reference), compiled for the GPU; the pytest tails in $OUT/families_tests.txt
#   spec-eagle     the bundled model with an EAGLE head ($EAGLE_HEAD, default models/pystdlib-llama-eagle; with
#                  $EAGLE_TRAIN_ARGS, one trained here first by builder.devtools.train_eagle --device cuda into
#                  $OUT/eagle-head): tests/runtime/test_eagle.py's and test_eagle3.py's CUDA tests, then
#                  builder.bench.speculative --eagle at each k of $SPEC_K (default 4) on held-out text, recorded
#                  (spec_speedup_eagle_b1[_kK], ...)
#   eagle-cost-PREC  Llama-3-8B shape (PREC as for 8b-PREC): the verify step's cost at each k of $VERIFY_K
#                  (default "1 2 4"; builder.bench.speculative --verify-cost, tagged _8b_PREC; with $VERIFY_AB_K, also
#                  at those k with the verify-step decode graphs off, tagged _8b_PREC_step_graphs), then an EAGLE-3 and an EAGLE-1
#                  proposal's time at each k of $SPEC_K (default "2 4") for random one-layer heads shaped like the
#                  model's layers (the EAGLE-3 one over a 32,000-token draft vocabulary; builder.bench.eagle_cost),
#                  recorded; $EAGLE_REQUESTS (default 1; e.g. "1 4 8"): requests drafting together in one proposal
#   dense-rows     kernels.dense_rows (unquantized linears at 3-16 rows): its CUDA tests, its table against cuBLAS at
#                  $DENSE_ROWS rows (default 3 5 8 16), then the 8B bf16 verify cost ($VERIFY_K) and decode steps at
#                  batch 4, 8, 16 with it and with those rows on cuBLAS (KERNELS_DENSE_ROWS_MAX=0, tagged
#                  _cublas_rows); with $ROWS_SWEEP (rows), a config sweep last
#   quickstart     build the bundled model's artifacts the smoke part runs (fp32, GPTQ, AWQ, FP8, SmoothQuant,
#                  INT8 weight-only)
#   smoke          the bundled model's artifacts on the CUDA serving path vs CPU (greedy tokens)
#   calib          bundled AWQ / SmoothQuant builds calibrated on the GPU; gate figures vs the CPU-built ones
#   8b-PREC        Llama-3-8B shape, PREC in bf16 fp8 awq gptq sq int8wo (recipes/bench/llama3-8b-PREC.yaml):
#                  checkpoint, build, kernel check, latency, throughput (128/128 at each concurrency of
#                  $THROUGHPUT_CONCURRENCY, default 64 128 256; 2048/128, 128/2048)
#   thr-PREC       only 8b-PREC's throughput points (after building), every figure recorded in $OUT/benchmarks.jsonl
#                  (throughput_IN_OUT_PREC: the best concurrency; _cC and preemptions_* per point)
#   thr-ab-PREC    A/B of settings on PREC's throughput: `builder bench throughput` with $AB_THROUGHPUT (default
#                  "--input-len 2048 --output-len 128 --concurrency 256") under each setting of $AB_SETTINGS (as ab-PREC;
#                  default "- RUNTIME_MIXED_DECODE_SPLIT=0"), $AB_ROUNDS rounds (default 1), one process each; JSON
#                  lines tagged with the setting in $OUT/thr_ab_PREC.jsonl; with AB_RECORD=1 the figures of the
#                  default setting ("-") recorded in $OUT/benchmarks.jsonl
#   thr-long-PREC  only the 128 in / 2048 out point, at each concurrency of $LONG_CONCURRENCY (default "256 512"), as
#                  many prompts as requests in flight (the long outputs fill the KV cache: FP8 vs bf16 caches)
#   b1-PREC        Llama-3-8B shape (PREC as for 8b-PREC), 128 in / 128 out: batch-1 latency and the decode step time
#                  at each batch size of $STEP_BATCH_SIZES (default 2 4 8 16; empty: batch 1 only), each beside the
#                  stock-PyTorch baseline (builder/bench/stock_torch.py) of the artifact's precision: bf16 for bf16,
#                  int4 for awq and gptq, int8wo for int8wo, fp8 and sq (record.STOCK_QUANT); every figure recorded
#                  in $OUT/benchmarks.jsonl (decode_b1_*, ttft_128_*, decode_step_bN_*, baseline_*), the log with
#                  the decode step table in $OUT/b1_PREC.log. The baseline compiles once per batch size
#                  (~90 s each); B1_BASELINE=0 leaves it out.
#   serve-PREC     the HTTP server against the offline engine on PREC, 128 in / 128 out, $SERVE_CONCURRENCY (default 256)
#                  requests in flight, 4x that many requests: `builder bench throughput` (offline), then `builder serve`
#                  with the engine in its own process (the default) and with `--engine-thread` ($SERVE_MODES, default
#                  "process thread"; $SERVE_STREAM_INTERVAL: the server's --stream-interval, default 1;
#                  $SERVE_API_SERVERS: the process mode's --api-servers, default 1), each loaded by
#                  `builder bench serve` with each client process count of $SERVE_WORKERS (default "4 1") after a
#                  warm-up wave; figures recorded (serve_throughput_128_128_PREC, serve_overhead_pct_PREC, ...).
#                  $SERVE_ARTIFACT overrides the artifact (e.g. artifacts/quickstart for a dry run on the CPU)
#   goodput-PREC   `builder serve` on PREC under Poisson arrivals, one `builder bench serve` rate sweep over
#                  $GOODPUT_RATES (req/s, default "60 80 100 110 120"), SLOs p99 TTFT <= 500 ms and p99 TPOT <= 50 ms;
#                  lengths by $GOODPUT_LENGTHS: uniform (default; 128 +/- 50% in and out, 10 s of arrivals per rate)
#                  or sharegpt (the synthetic ShareGPT-like mix, --length-dist sharegpt; 1000 requests per rate);
#                  $GOODPUT_NUM_REQUESTS sets the requests per rate for either. Records serve_goodput_rps_PREC (the
#                  sweep's goodput rate: the highest rate with no failed request and both p99s within their SLOs);
#                  the sweep JSON in $OUT/goodput_PREC.json, its table in $OUT/goodput_PREC.log; $GOODPUT_TAG (e.g.
#                  _hold0, with RUNTIME_PREFILL_HOLD_MS=0) is appended to the files' and figure's names
#   structured-PREC  structured-output overhead (builder.bench.structured --breakdown, batch 1 and 64, JSON schema vs
#                  free) on artifacts/llama3-8b-PREC served with a 128k byte-level BPE tokenizer trained here
#                  (builder.devtools.train_tokenizer, checkpoints/bpe-128k; first builder.bench.grammar_masks on it: 64
#                  rows' mask fill by how the grammar states were made), then on artifacts/quickstart; each with
#                  the masks filled beside the record (default) and after it (RUNTIME_MASK_OVERLAP=0); figures in
#                  $OUT/benchmarks.jsonl (the A/B's second run tagged by its log only), logs $OUT/structured_*.log
#   build-PREC     only build artifacts/llama3-8b-PREC (and the checkpoint), for later parts on the same machine
#   fusions-PREC   builder.devtools.check_kernels --fusions: PREC's kernel path with and without the cross-node
#                  fusions (logits at 1-130 rows, greedy tokens), JSON lines in $OUT/fusions_PREC.jsonl
#   stock-QUANT    the stock-PyTorch baseline alone, QUANT in bf16 int8wo int4
#   ab-PREC        A/B of kernel launch settings on PREC's batch-1 decode (128 in / 128 out, no baseline): each setting
#                  of $AB_SETTINGS (space-separated; a setting is comma-separated VAR=VALUE, "-" for none; default
#                  "- KERNELS_PDL=0 KERNELS_PREFETCH=0"), run $AB_ROUNDS times (default 2) in turn, JSON lines tagged
#                  with the setting in $OUT/ab_PREC.jsonl
#   mma-ab         the W4A16 kernel table at 1 and 16 rows under each setting of $AB_SETTINGS (kernel-level A/B)
#   frag-ab        the frag W4A16 kernel at one row (default config) under each setting of $AB_SETTINGS (default
#                  "- KERNELS_PDL_EARLY=1")
#   tree-ab-PREC   PREC's latency (TTFT, batch 1 and the decode step at each of $STEP_BATCH_SIZES, default 96) and
#                  128/128 throughput at $THROUGHPUT_CONCURRENCY (default 256; empty: none) from this tree (recorded) and from the
#                  source tree at $AB_TREE (e.g. `git archive BASE | tar -x -C abtree`, carried; printed, tagged
#                  "tree": "base" in $OUT/tree_ab_PREC.jsonl), same artifact, one process each
#   ncu-decode     Nsight Compute (--set full, clocks left alone) of the batch-1 decode kernels at the 8B shape
#                  (kernels.bench.ncu_decode: frag W4A16 and dense bf16 GEMVs, decode attention over
#                  $NCU_CONTEXT keys); $OUT/ncu_decode.ncu-rep, the details page in $OUT/ncu_decode.txt and each
#                  kernel's SASS with its stall counters in $OUT/ncu_source_*.csv ($NCU_KERNELS: which groups)
#   profile-PREC   torch.profiler of prefill and decode steps of PREC at each concurrency of $PROFILE_CONCURRENCY
#                  (default 64; concurrency 1 profiles the batch-1 prefill behind TTFT), $PROFILE_INPUT_LEN tokens
#   hf | hf-compile  the Hugging Face baseline on the same checkpoint
#   train-sweep    candidate sizes of the bundled model trained side by side on the GPU (builder.devtools.train_bundled
#                  --device cuda on the stdlib carried in .corpus/stdlib-VERSION.tar.gz, made here by `python -m
#                  builder.devtools.train_bundled --pack-stdlib .corpus/stdlib-$(python3 -V | cut -d' ' -f2).tar.gz`):
#                  $TRAIN_CONFIGS, '|'-separated option sets, each into /tmp/cand-N with its log in
#                  $OUT/train_cand_N.log; a table of held-out perplexities in $OUT/train_sweep.txt
#   train-bundled  the bundled model trained on the GPU into models/pystdlib-llama with $TRAIN_ARGS (same corpus), then
#                  its draft (builder.devtools.train_draft --device cuda $DRAFT_ARGS) into models/pystdlib-llama-draft;
#                  both directories packed into $OUT/bundled.tar.gz.partNN (15 MB parts: cat them, then tar -xzf)
#   train-candidates  like train-sweep ($TRAIN_CONFIGS side by side into /tmp/cand-N), then a draft for each
#                  (builder.devtools.train_draft --device cuda $DRAFT_ARGS, side by side into /tmp/cand-N-draft); the
#                  logs in $OUT/train_logs.txt; each candidate of $PACK_CANDIDATES (default all; a call brings back 8
#                  files) and its draft packed into $OUT/candN.tar.gz.partNN (15 MB parts); with $SPEC_CANDIDATE=N
#                  that candidate and its draft are then copied over models/ and spec-draft runs on them
#   spec-draft     the bundled model and its draft built (recipes/quickstart.yaml, quickstart-draft.yaml), then
#                  builder.bench.speculative with the draft on held-out text, greedy, batch 1; spec_speedup_draft_b1
#                  and its companions in $OUT/benchmarks.jsonl
#   tp-check       (2 GPUs) tests/runtime/test_collectives.py (the one-shot all-reduce against NCCL), then
#                  builder.devtools.tp_check on CUDA: the bundled model (fp32) and the tiny MoE preset (fp32, bf16, fp8),
#                  each built at tp_size 1 and 2 (greedy tokens and logits, offline and serving engines; the serving
#                  engine's decode and prefill steps replay CUDA graphs on every rank, TPDecodeGraphs / TPStepGraphs)
#   tp-8b          (2 GPUs) Llama-3-8B bf16 TP=1 vs TP=2: batch-1 latency and 128/128 throughput at concurrency 64,
#                  with CUDA-graph decode and eager (TP_EAGER= skips eager); TP_ARTIFACTS="bf16-tp2": TP=2 only;
#                  tp2_speedup_b1_8b recorded when both ran; each $TP_ONE_SHOT_AB value (e.g. "0") runs the TP=2
#                  artifact again with LLM_BUILDER_TP_ONE_SHOT_BYTES set to it
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
CKPT=checkpoints/llama3-8b-random
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

ckpt() { [ -d $CKPT ] || python3 -m builder.devtools.make_checkpoint --preset llama3-8b --out $CKPT 2>&1 | tail -1; }
artifact() {  # build artifacts/llama3-8b-$1 once
  ckpt
  if [ ! -d artifacts/llama3-8b-$1 ]; then
    t0=$(date +%s)
    python3 -m builder.cli build recipes/bench/llama3-8b-$1.yaml --quiet 2>&1 | tail -3
    echo "{\"build\": \"llama3-8b-$1\", \"seconds\": $(( $(date +%s) - t0 ))}" | tee -a "$OUT/bench_8b.jsonl"
  fi
}
bench() { python3 -m builder.cli bench "$@" --json "$OUT/bench_8b.jsonl" 2>&1 | grep '^{'; }
throughput_runs() {  # the offline throughput points of issue 17, recorded in $OUT/benchmarks.jsonl
  local rec="--record $OUT/benchmarks.jsonl" sweep=""
  for c in ${THROUGHPUT_CONCURRENCY:-64 128 256}; do sweep="$sweep --concurrency $c"; done
  bench throughput artifacts/llama3-8b-$1 --input-len 128 --output-len 128 $sweep $rec
  bench throughput artifacts/llama3-8b-$1 --input-len 2048 --output-len 128 --concurrency 64 $rec
  bench throughput artifacts/llama3-8b-$1 --input-len 128 --output-len 2048 --concurrency 256 --num-prompts 256 $rec
}

unpack_corpus() {  # the stdlib corpus carried in .corpus/stdlib-VERSION.tar.gz into /tmp/stdlib; sets $version
  local tarball
  tarball=$(ls .corpus/stdlib-*.tar.gz 2>/dev/null | head -n 1)
  [ -n "$tarball" ] || return 1
  version=$(basename "$tarball" .tar.gz); version=${version#stdlib-}
  rm -rf /tmp/stdlib && mkdir -p /tmp/stdlib && tar -xzf "$tarball" -C /tmp/stdlib
}

moe_e2e() {  # $1: precision; the Qwen3-30B-A3B-shaped model from checkpoint to throughput (moe-e2e in the header)
  local prec=$1 layers=${MOE_LAYERS:-48} ck=checkpoints/qwen3-30b-a3b-random art=/dev/shm/qwen3-30b-a3b-$1 t0 need
  local rec="--record $OUT/benchmarks.jsonl" log="$OUT/moe_e2e.jsonl" make="" bytes=2
  # fp8blocks: a checkpoint pre-quantized as Qwen3-30B-A3B-FP8 is published (fine-grained FP8, 128 x 128 blocks)
  [ "$prec" = fp8blocks ] && { ck=checkpoints/qwen3-30b-a3b-fp8blocks; make="--fp8-blocks 128"; bytes=1; }
  # a dry run's figures are those of another model: recorded apart, under the same names
  [ "$layers" = 48 ] || { ck=$ck-L$layers; art=$art-L$layers; rec="--record $OUT/moe_dry_run_L$layers.jsonl"; }
  phase() {  # phase NAME STATUS: the seconds since t0
    printf '{"phase": "%s", "precision": "%s", "layers": %s, "rc": %s, "seconds": %s}\n' "$1" "$prec" "$layers" "$2" \
      $(( $(date +%s) - t0 )) | tee -a "$log"
  }
  t0=$(date +%s)
  if [ ! -f $ck/calibration.jsonl ]; then  # make_checkpoint's last file
    need=$(( (623 * layers * bytes + 623 * 2) / 1000 + 2 ))  # GB: 623M parameters a layer, 623M embedding + lm_head
    if [ $(( $(df --output=avail -B1000000000 . | tail -1) )) -lt $need ]; then
      echo "moe-e2e: the checkpoint needs ${need} GB of disk, $(df -h --output=avail . | tail -1) free: run moe-e2e" \
        "first in a call (the checkpoints of other parts take the room)"; return 1
    fi
    rm -rf $ck
    python3 -m builder.devtools.make_checkpoint --preset qwen3-30b-a3b --num-hidden-layers $layers --device cuda \
      --out $ck $make 2>&1 | tail -1
    phase checkpoint ${PIPESTATUS[0]}
  fi
  rm -rf /dev/shm/qwen3-30b-a3b-*  # one 57 GiB artifact in RAM at a time
  t0=$(date +%s)
  python3 -m builder.cli build recipes/bench/qwen3-30b-a3b-$prec.yaml --set model.checkpoint=$ck \
    --set output_dir=$art > "$OUT/moe_build_$prec.log" 2>&1
  phase build $?
  tail -n 2 "$OUT/moe_build_$prec.log"
  [ -f $art/manifest.json ] || return 1
  t0=$(date +%s)
  python3 -m builder.cli bench latency $art --input-len 128 --output-len 128 $rec 2>&1 \
    | tee "$OUT/moe_latency_$prec.log" | grep '^{'
  phase latency ${PIPESTATUS[0]}
  t0=$(date +%s)
  python3 -m builder.cli bench throughput $art --input-len 128 --output-len 128 --concurrency 64 --concurrency 128 \
    $rec 2>&1 | tee "$OUT/moe_throughput_$prec.log" | grep '^{'
  phase throughput ${PIPESTATUS[0]}
}

for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    kernels)
      python3 -m kernels.bench.attention 2>&1 | tee "$OUT/bench_attention.txt" | tail -n 25
      python3 -m kernels.bench.gemm 2>&1 | tee "$OUT/bench_gemm.txt" | tail -n 40
      python3 -m kernels.bench.w8a8 2>&1 | tee "$OUT/bench_w8a8.txt" ;;
    prefill-sweep)
      python3 -m kernels.bench.attention --prefill-sweep 2>&1 | tee "$OUT/prefill_sweep.txt" \
        | grep -E '^best-config|FAIL|Error' ;;
    own-kv-*)
      # the prefill attention of fresh prompts over the step's own K/V (RUNTIME_PREFILL_OWN_KV) against the cache's
      # blocks: its tilings at the sweep's shapes, then PREC's 2048/128 throughput and 2,048-token TTFT with it off / on
      prec=${part#own-kv-}
      python3 -m kernels.bench.attention --prefill-sweep --sweep-kv bf16 --sweep-own-kv 2>&1 \
        | tee "$OUT/prefill_own_kv_sweep.txt" | grep -E '^best-config|FAIL|Error'
      artifact "$prec"
      for own in 0 1; do
        RUNTIME_PREFILL_OWN_KV=$own python3 -m builder.cli bench throughput artifacts/llama3-8b-$prec \
          --input-len 2048 --output-len 128 --concurrency 64 2>&1 | grep '^{' | sed "s|^{|{\"own_kv\": $own, |" \
          | tee -a "$OUT/own_kv_$prec.jsonl"
        RUNTIME_PREFILL_OWN_KV=$own python3 -m builder.cli bench latency artifacts/llama3-8b-$prec \
          --input-len 2048 --output-len 32 2>&1 | grep '^{' | sed "s|^{|{\"own_kv\": $own, |" \
          | tee -a "$OUT/own_kv_$prec.jsonl"
      done ;;
    silu-quant)
      TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_elementwise.py 2>&1 | tail -n 3
      python3 -m kernels.bench.silu_quant --chunks ${SILU_CHUNKS:-0 1024 2048 4096} 2>&1 \
        | tee "$OUT/bench_silu_quant.txt" ;;
    w8a8-sweep)
      python3 -m kernels.bench.w8a8 --kind fp8 --sweep 2>&1 | tee "$OUT/bench_w8a8_sweep.txt" ;;
    w4a8)
      python3 -m kernels.bench.gemm --w4a8 --rows ${W4A8_ROWS:-128 256 512} ${W4A8_ARGS:-} 2>&1 \
        | tee "$OUT/bench_w4a8.txt" | grep -vE "^ +(cand|sweep)" | tail -n 40
      TRITON_INTERPRET=0 timeout ${W4A8_TEST_TIMEOUT:-300} python3 -m pytest -o addopts= -q -p no:cacheprovider \
        tests/kernels/test_w4a8.py tests/kernels/test_frag_mm.py 2>&1 | tee "$OUT/w4a8_tests.txt" | tail -n 15 ;;
    moe)
      TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_kernel.py \
        tests/runtime/test_executor_moe.py 2>&1 | tee "$OUT/moe_tests.txt" | tail -n 15
      sweep=""; [ "${MOE_SWEEP:-0}" = 1 ] && sweep="--sweep --tokens 1 64 1024"
      python3 -m kernels.bench.moe $sweep 2>&1 | tee "$OUT/bench_moe.txt" | tail -n 40 ;;
    moe-prequant-smoke)
      # block-FP8 experts on the GPU: the kernels' tests (real shapes included), then a tiny MoE pre-quantized as
      # fine-grained FP8 (32 x 32 blocks), built and served on CUDA against the CPU path (greedy tokens)
      TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_kernel.py -k block_fp8 2>&1 \
        | tee "$OUT/moe_block_fp8_tests.txt" | tail -n 5
      for dt in ${SMOKE_DTYPES:-bfloat16 float32}; do
        ck=/tmp/tiny-moe-fp8blocks-$dt
        rm -rf $ck $ck-art
        python3 -m builder.devtools.make_checkpoint --preset tiny-moe --out $ck --dtype $dt --fp8-blocks 32 2>&1 \
          | tail -1
        python3 -m builder.cli build recipes/bench/qwen3-30b-a3b-fp8blocks.yaml --set model.checkpoint=$ck \
          --set output_dir=$ck-art --set model.dtype=$dt --set runtime.max_seq_len=512 --quiet 2>&1 | tail -2
        python3 -m builder.devtools.cuda_smoke $ck-art 2>&1 | grep --line-buffered -v Warning \
          | tee -a "$OUT/moe_prequant_smoke.txt"
      done ;;
    families)
      TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_elementwise.py \
        tests/runtime/test_executor_families.py 2>&1 | tee "$OUT/families_tests.txt" | tail -n 15 ;;
    70b-fp8)
      tp=${TP70:-1}; ck=/dev/shm/llama3-70b-fp8; art=artifacts/llama3-70b-fp8-tp$tp; t0=$(date +%s)
      if [ ! -f $ck/calibration.jsonl ]; then  # make_checkpoint's last file
        rm -rf $ck
        python3 -m builder.devtools.make_checkpoint --preset llama3-70b --fp8-channel --device cuda --out $ck 2>&1 \
          | tail -1
      fi
      echo "{\"phase\": \"checkpoint\", \"seconds\": $(( $(date +%s) - t0 ))}"
      if [ ! -f $art/manifest.json ]; then
        rm -rf artifacts/llama3-70b-fp8-tp*  # one 70 GB artifact on the disk at a time
        if [ $(( $(df --output=avail -B1000000000 . | tail -1) )) -lt 75 ]; then
          echo "70b-fp8: the artifact needs 75 GB of disk, $(df -h --output=avail . | tail -1) free"; continue
        fi
        t0=$(date +%s)
        python3 -m builder.cli build recipes/bench/llama3-70b-fp8.yaml --set parallel.tp_size=$tp \
          --set output_dir=$art --quiet 2>&1 | tail -2
        echo "{\"phase\": \"build\", \"tp\": $tp, \"seconds\": $(( $(date +%s) - t0 ))}"
      fi
      raw="$OUT/raw_70b_tp$tp.jsonl"; lat="$OUT/lat_70b_tp$tp.jsonl"
      python3 -m builder.cli bench latency $art --input-len 128 --output-len 128 --json "$lat" --record "$raw" 2>&1 \
        | grep '^{'
      python3 -m builder.cli bench throughput $art --input-len 128 --output-len 128 \
        ${THROUGHPUT70:---concurrency 64 --concurrency 128 --concurrency 256} --record "$raw" 2>&1 | grep '^{'
      python3 - "$raw" "$lat" "$tp" "$OUT/benchmarks.jsonl" <<'PY'
import json, re, sys

raw, lat, tp, out = sys.argv[1:]
rows = [json.loads(line) for line in open(raw)]
for row in rows:  # decode_b1_fp8 -> tp1_decode_b1_fp8_70b; throughput_128_128_fp8_c64 -> tp1_..._fp8_70b_c64
    m = re.fullmatch(r"(.*?)(_c\d+)?", row["figure"])
    row["figure"] = f"tp{tp}_{m.group(1)}_70b{m.group(2) or ''}"
b1 = next((r for r in rows if r["figure"] == f"tp{tp}_decode_b1_fp8_70b"), None)
pct = [json.loads(line).get("roofline_pct") for line in open(lat)]
if b1 is not None and pct and pct[0] is not None:
    rows.append({**b1, "figure": f"tp{tp}_roofline_pct_b1_70b", "value": pct[0], "unit": "%"})
with open(out, "a") as f:
    for row in rows:
        print(json.dumps(row))
        f.write(json.dumps(row) + "\n")
PY
      ;;
    moe-e2e|moe-e2e-*)
      prec=${part#moe-e2e}; prec=${prec#-}; moe_e2e "${prec:-bf16}"
      ;;
    spec-eagle)
      [ -d artifacts/quickstart ] || python3 -m builder.cli build recipes/quickstart.yaml --quiet 2>&1 | tail -2
      head=${EAGLE_HEAD:-models/pystdlib-llama-eagle}
      if [ -n "${EAGLE_TRAIN_ARGS:-}" ]; then  # a head trained here first (on this GPU), into $OUT/eagle-head
        python3 -m builder.devtools.train_eagle --device cuda --out "$OUT/eagle-head" $EAGLE_TRAIN_ARGS 2>&1 \
          | tee "$OUT/train_eagle.log" | tail -4
        head="$OUT/eagle-head"
      fi
      TRITON_INTERPRET=0 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/runtime/test_eagle.py \
        tests/runtime/test_eagle3.py -k cuda \
        2>&1 | tail -3 | tee "$OUT/eagle_tests.txt"
      for k in ${SPEC_K:-4}; do
        python3 -m builder.bench.speculative artifacts/quickstart --device cuda --eagle "$head" \
          --text models/pystdlib-llama/eval.txt --prompts ${SPEC_PROMPTS:-8} --num-draft $k --output-len 128 \
          --record "$OUT/benchmarks.jsonl" $( [ $k = 4 ] || echo --tag _k$k ) 2>&1 | tee -a "$OUT/spec_eagle.log" \
          | grep -E '^\{|speedup|accept'
      done ;;
    eagle-cost-*)
      prec=${part#eagle-cost-}
      artifact "$prec"
      python3 -m builder.bench.speculative artifacts/llama3-8b-$prec --device cuda --no-speedup \
        --verify-cost ${VERIFY_K:-1 2 4} --tag _8b_$prec --record "$OUT/benchmarks.jsonl" 2>&1 | grep -E 'verify|K ='
      if [ -n "${VERIFY_AB_K:-}" ]; then  # the same on the step graphs (verify steps as prompts), tagged _step_graphs
        RUNTIME_VERIFY_DECODE_BUCKETS=0 python3 -m builder.bench.speculative artifacts/llama3-8b-$prec --device cuda \
          --no-speedup --verify-cost $VERIFY_AB_K --tag _8b_${prec}_step_graphs --record "$OUT/benchmarks.jsonl" 2>&1 \
          | grep -E 'verify|K ='
      fi
      for variant in --eagle3 ""; do
        python3 -m builder.bench.eagle_cost artifacts/llama3-8b-$prec --config $CKPT/config.json $variant \
          --num-draft ${SPEC_K:-2 4} --requests ${EAGLE_REQUESTS:-1} --tag _8b_$prec --record "$OUT/benchmarks.jsonl" \
          2>&1 | grep -E 'EAGLE|Error'
      done ;;
    dense-rows)  # kernels.dense_rows: GPU tests, kernel table vs cuBLAS, then end to end on the 8B bf16 (A/B)
      python3 -m pytest -q -o addopts= -p no:cacheprovider tests/kernels/test_dense_rows.py -k cuda 2>&1 | tail -2
      python3 -m kernels.bench.dense --dense-rows ${DENSE_ROWS:-3 5 8 16} 2>&1 | tee "$OUT/dense_rows.txt" \
        | grep -E '^ *(qkv|o_proj|gate_up|down|lm_head|step) |FAIL|checks'
      artifact bf16
      for setting in "" 0; do  # "": the default (dense_rows at 3-16 rows); 0: those rows on cuBLAS
        tag=_8b_bf16$( [ -z "$setting" ] || echo _cublas_rows )
        KERNELS_DENSE_ROWS_MAX=${setting:-16} python3 -m builder.bench.speculative artifacts/llama3-8b-bf16 \
          --device cuda --no-speedup --verify-cost ${VERIFY_K:-1 2 4 8} --tag $tag --record "$OUT/benchmarks.jsonl" \
          2>&1 | grep -E 'verify|K ='
        KERNELS_DENSE_ROWS_MAX=${setting:-16} python3 -m builder.cli bench latency artifacts/llama3-8b-bf16 \
          --input-len 128 --output-len 128 --batch-size 4 --batch-size 8 --batch-size 16 2>&1 \
          | grep -E '^decode step|^batch|^ +[0-9]' | sed "s/^/[$tag] /"
      done
      [ -n "${ROWS_SWEEP:-}" ] && python3 -m kernels.bench.dense --dense-rows $ROWS_SWEEP --rows-sweep 2>&1 \
        | tee "$OUT/dense_rows_sweep.txt" | grep -E 'M=|^ +[0-9]|us ' | head -60 ;;
    quickstart)
      for r in "" -gptq -awq -fp8 -smoothquant -int8_wo; do
        [ -d artifacts/quickstart$r ] || python3 -m builder.cli build recipes/quickstart$r.yaml --quiet 2>&1 | tail -2
      done ;;
    smoke)
      python3 -m builder.devtools.cuda_smoke artifacts/quickstart artifacts/quickstart-gptq artifacts/quickstart-awq \
        artifacts/quickstart-fp8 artifacts/quickstart-smoothquant artifacts/quickstart-int8_wo 2>&1 | grep --line-buffered -v Warning \
        | tee "$OUT/cuda_smoke.txt" ;;
    calib)
      for algo in awq smoothquant; do
        t0=$(date +%s)
        python3 -m builder.cli build recipes/quickstart-$algo.yaml --quiet --set calibration.device=cuda \
          --set output_dir=artifacts/quickstart-$algo-gpucal 2>&1 | tail -2
        echo "$algo built with GPU calibration in $(( $(date +%s) - t0 )) s"
        python3 - "$algo" <<'PY' | tee -a "$OUT/calib.txt"
import json, sys
algo = sys.argv[1]
for tag, path in (("cpu", f"artifacts/quickstart-{algo}"), ("cuda", f"artifacts/quickstart-{algo}-gpucal")):
    m = json.load(open(f"{path}/manifest.json"))
    g = m["quantization"].get("gates") or {}
    metrics = {r["name"]: round(r["value"], 5) for r in g.get("metrics", [])}
    print(json.dumps({"algo": algo, "calibrated_on": tag, "passed": g.get("passed"), **metrics,
                      "quantization_s": round(m["build"]["timings_s"].get("quantization_s", -1), 1)}))
PY
      done ;;
    8b-*)
      prec=${part#8b-}
      artifact "$prec"
      python3 -m builder.devtools.check_kernels artifacts/llama3-8b-$prec 2>&1 | tail -1 | tee -a "$OUT/bench_8b.jsonl"
      bench latency artifacts/llama3-8b-$prec --input-len 128 --input-len 2048 --output-len 128
      throughput_runs "$prec" ;;
    thr-long-*)
      prec=${part#thr-long-}
      artifact "$prec"
      sweep=""; for c in ${LONG_CONCURRENCY:-256 512}; do sweep="$sweep --concurrency $c"; done
      bench throughput artifacts/llama3-8b-$prec --input-len 128 --output-len 2048 $sweep --waves 1 \
        --record "$OUT/benchmarks.jsonl" ;;
    thr-ab-*)
      prec=${part#thr-ab-}
      artifact "$prec"
      for round in $(seq ${AB_ROUNDS:-1}); do
        for setting in ${AB_SETTINGS:-- RUNTIME_MIXED_DECODE_SPLIT=0}; do
          envs=(); [ "$setting" = - ] || IFS=, read -ra envs <<< "$setting"
          rec=(); [ "$setting" = - ] && [ "${AB_RECORD:-0}" = 1 ] && rec=(--record "$OUT/benchmarks.jsonl")
          env "${envs[@]}" python3 -m builder.cli bench throughput artifacts/llama3-8b-$prec \
            ${AB_THROUGHPUT:---input-len 2048 --output-len 128 --concurrency 256} "${rec[@]}" 2>&1 | grep '^{' \
            | sed "s|^{|{\"setting\": \"$setting\", \"round\": $round, |" | tee -a "$OUT/thr_ab_$prec.jsonl" \
            | cut -c1-300
        done
      done ;;
    thr-*)
      prec=${part#thr-}
      artifact "$prec"
      throughput_runs "$prec" ;;
    b1-*)
      prec=${part#b1-}
      artifact "$prec"
      steps=""; for b in ${STEP_BATCH_SIZES-2 4 8 16}; do steps="$steps --batch-size $b"; done
      base="--baseline $CKPT"; [ "${B1_BASELINE:-1}" = 0 ] && base=""
      python3 -m builder.cli bench latency artifacts/llama3-8b-$prec --input-len 128 --output-len 128 $steps \
        $base --record "$OUT/benchmarks.jsonl" 2>&1 | tee "$OUT/b1_$prec.log" \
        | grep -E '^\{|^decode step|^batch|^ +[0-9]' ;;
    serve-*)
      prec=${part#serve-}
      art=${SERVE_ARTIFACT:-artifacts/llama3-8b-$prec}; [ -n "${SERVE_ARTIFACT:-}" ] || artifact "$prec"
      c=${SERVE_CONCURRENCY:-256}; port=${SERVE_PORT:-8000}
      dev=""; [ -n "${SERVE_DEVICE:-}" ] && dev="--device $SERVE_DEVICE"
      python3 -m builder.cli bench throughput $art --input-len 128 --output-len 128 --concurrency $c $dev \
        --json "$OUT/serve_${prec}_offline.json" 2>&1 | grep '^{'
      for mode in ${SERVE_MODES:-process thread}; do
        flag=""; [ $mode = thread ] && flag="--engine-thread"
        api=""; [ $mode = process ] && api="--api-servers ${SERVE_API_SERVERS:-1}"
        python3 -m runtime.serve $art --port $port --max-num-seqs $c $flag $dev --log-level warning \
          --stream-interval ${SERVE_STREAM_INTERVAL:-1} $api &
        pid=$!
        for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
        client="python3 -m builder.cli bench serve --url http://127.0.0.1:$port --tokenizer $art --input-len 128 \
          --output-len 128 --concurrency $c --quiet"
        $client --num-requests $c --workers 4 > /dev/null  # warm-up wave
        for w in ${SERVE_WORKERS:-4 1}; do
          $client --num-requests $((4 * c)) --workers $w --json "$OUT/serve_${prec}_${mode}_w$w.json" \
            | grep -E 'throughput|TTFT|TPOT'
        done
        kill -INT $pid; wait $pid
      done
      thread=(); for f in "$OUT"/serve_${prec}_thread_w*.json; do [ -e "$f" ] && thread+=("$f"); done
      python3 -m builder.bench.serve_overhead --record "$OUT/benchmarks.jsonl" --precision $prec \
        --api-servers ${SERVE_API_SERVERS:-1} \
        --offline "$OUT/serve_${prec}_offline.json" --served "$OUT"/serve_${prec}_process_w*.json \
        ${thread[@]:+--thread "${thread[@]}"} ;;
    goodput-*)
      prec=${part#goodput-}
      art=${SERVE_ARTIFACT:-artifacts/llama3-8b-$prec}; [ -n "${SERVE_ARTIFACT:-}" ] || artifact "$prec"
      port=${SERVE_PORT:-8000}
      python3 -m runtime.serve $art --port $port --log-level warning &
      pid=$!
      for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
      lengths="--input-len 128 --output-len 128 --range-ratio 0.5"; load="--duration 10"
      desc="128 +/- 50% tokens in and out"
      if [ "${GOODPUT_LENGTHS:-uniform}" = sharegpt ]; then
        lengths="--length-dist sharegpt"; load="--num-requests 1000"; desc="synthetic ShareGPT-like lengths"
      fi
      [ -n "${GOODPUT_NUM_REQUESTS:-}" ] && load="--num-requests $GOODPUT_NUM_REQUESTS"
      client="python3 -m builder.cli bench serve --url http://127.0.0.1:$port --tokenizer $art $lengths \
        --slo ttft=500 --slo tpot=50 --workers 4 --quiet"
      $client --num-requests 256 --concurrency 256 > /dev/null  # warm-up wave
      rates=""; for r in ${GOODPUT_RATES:-60 80 100 110 120}; do rates="$rates --request-rate $r"; done
      name="${prec}${GOODPUT_TAG:-}"
      COLUMNS=160 $client $rates $load --json "$OUT/goodput_$name.json" 2>&1 | tee "$OUT/goodput_$name.log"
      kill -INT $pid; wait $pid
      # the goodput rate by bench serve's criterion (builder.bench.serve.meets_slos); one rate gives a bench_serve
      how="GOODPUT_LENGTHS=${GOODPUT_LENGTHS:-uniform} bash builder/devtools/gpu_suite.sh $part ($load per rate; $desc)"
      python3 - "$OUT/goodput_$name.json" "$name" "$OUT/benchmarks.jsonl" "$how" <<'PY'
import json, sys

import torch

from builder.bench.record import append_figures
from builder.bench.serve import meets_slos

path, name, record, how = sys.argv[1:]
with open(path) as f:
    result = json.load(f)
runs = result["runs"] if result["kind"] == "bench_serve_sweep" else [result]
slos = runs[0]["goodput"]["slos_ms"]
rate = max([r["config"]["request_rate"] for r in runs if meets_slos(r, slos)], default=0.0)
rates = " ".join(format(r["config"]["request_rate"], "g") for r in runs)
device = "cuda" if torch.cuda.is_available() else "cpu"
append_figures(record, [(f"serve_goodput_rps_{name}", rate, "req/s")], device,
               f"{how}: rates {rates}; p99 TTFT <= {slos['ttft']:g} ms, "
               f"p99 TPOT <= {slos['tpot']:g} ms")
print(json.dumps({f"serve_goodput_rps_{name}": rate}))
PY
      ;;
    build-*)
      artifact "${part#build-}" ;;
    fusions-*)
      prec=${part#fusions-}
      artifact "$prec"
      python3 -m builder.devtools.check_kernels artifacts/llama3-8b-$prec --fusions 2>&1 | grep '^{' \
        | tee -a "$OUT/fusions_$prec.jsonl" ;;
    structured-*)
      prec=${part#structured-}
      [ -d checkpoints/bpe-128k ] || python3 -m builder.devtools.train_tokenizer checkpoints/bpe-128k --max-mb 120 \
        > "$OUT/train_tokenizer.log" 2>&1 &
      artifact "$prec"
      wait
      tail -n 1 "$OUT/train_tokenizer.log"
      python3 -m builder.bench.grammar_masks checkpoints/bpe-128k --rows 64 --steps 32 --templates 1 4 13 2>&1 \
        | tee "$OUT/grammar_masks.log" | tail -n 6
      for overlap in 1 0; do
        rec=""; [ $overlap = 1 ] && rec="--record $OUT/benchmarks.jsonl"
        RUNTIME_MASK_OVERLAP=$overlap python3 -m builder.bench.structured artifacts/llama3-8b-$prec --device cuda \
          --tokenizer checkpoints/bpe-128k --batch-size 1 --batch-size 64 --repeats 3 --breakdown $rec 2>&1 \
          | tee "$OUT/structured_${prec}_overlap$overlap.log" | grep -v Warning | tail -n 12
        RUNTIME_MASK_OVERLAP=$overlap python3 -m builder.bench.structured artifacts/quickstart --device cuda \
          --batch-size 1 --batch-size 64 --repeats 3 --breakdown $rec 2>&1 \
          | tee "$OUT/structured_quickstart_overlap$overlap.log" | grep -v Warning | tail -n 12
      done ;;
    ab-*)
      prec=${part#ab-}
      artifact "$prec"
      for round in $(seq ${AB_ROUNDS:-2}); do
        for setting in ${AB_SETTINGS:-- KERNELS_PDL=0 KERNELS_PREFETCH=0}; do
          envs=(); [ "$setting" = - ] || IFS=, read -ra envs <<< "$setting"
          env "${envs[@]}" python3 -m builder.cli bench latency artifacts/llama3-8b-$prec --input-len 128 \
            --output-len 128 2>&1 | grep '^{' \
            | sed "s|^{|{\"setting\": \"$setting\", \"round\": $round, |" | tee -a "$OUT/ab_$prec.jsonl"
        done
      done ;;
    tree-ab-*)
      prec=${part#tree-ab-}
      artifact "$prec"
      root=$PWD; base=$(cd "${AB_TREE:?AB_TREE: the base source tree}" && pwd)
      steps=""; for b in ${STEP_BATCH_SIZES-96}; do steps="$steps --batch-size $b"; done
      conc=""; for c in ${THROUGHPUT_CONCURRENCY-256}; do conc="$conc --concurrency $c"; done
      cmds=("latency $root/artifacts/llama3-8b-$prec --input-len 128 --output-len 128 $steps")
      [ -z "$conc" ] || cmds+=("throughput $root/artifacts/llama3-8b-$prec --input-len 128 --output-len 128 $conc")
      for tree in "$root" "$base"; do
        tag=this; rec="--record $OUT/benchmarks.jsonl"; [ "$tree" = "$root" ] || { tag=base; rec=""; }
        for cmd in "${cmds[@]}"; do
          (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH python3 -m builder.cli bench $cmd $rec 2>&1) | tee -a "$OUT/tree_ab_$prec.log" \
            | grep '^{' | sed "s/^{/{\"tree\": \"$tag\", /" | tee -a "$OUT/tree_ab_$prec.jsonl" | cut -c1-600
        done
      done ;;
    mma-ab)
      for setting in ${AB_SETTINGS:-- KERNELS_PDL=0 KERNELS_PREFETCH=0}; do
        envs=(); [ "$setting" = - ] || IFS=, read -ra envs <<< "$setting"
        echo "--- setting $setting"
        env "${envs[@]}" python3 -m kernels.bench.gemm --mma --bits 4 --rows 1 16 2>&1 | tee -a "$OUT/mma_ab.txt" \
          | grep -v Warning | tail -n 12
      done ;;
    frag-ab)
      for setting in ${AB_SETTINGS:-- KERNELS_PDL_EARLY=1}; do
        envs=(); [ "$setting" = - ] || IFS=, read -ra envs <<< "$setting"
        echo "--- setting $setting" | tee -a "$OUT/frag_ab.txt"
        env "${envs[@]}" python3 -m kernels.bench.gemm --frag --no-sweep --rows 1 2>&1 | tee -a "$OUT/frag_ab.txt" \
          | grep -v Warning | grep -v dequantize | tail -n 6
      done ;;
    stock-*)
      ckpt
      python3 -m builder.bench.stock_torch $CKPT --quant ${part#stock-} 2>&1 | tee "$OUT/stock_${part#stock-}.log" \
        | grep '^{' | tee -a "$OUT/bench_8b.jsonl" ;;
    ncu-decode)
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
      [ -n "$ncu_bin" ] || { echo "ncu-decode: no ncu on this machine"; continue; }
      "$ncu_bin" --version | tail -n 1
      "$ncu_bin" --profile-from-start off --clock-control none --set full --import-source yes -f \
        -o "$OUT/ncu_decode" python3 -m kernels.bench.ncu_decode --kernels ${NCU_KERNELS:-w4a16 dense attention} \
        --context ${NCU_CONTEXT:-192} 2>&1 | grep -v '^==PROF==' | tail -n 12
      "$ncu_bin" --import "$OUT/ncu_decode.ncu-rep" --page details > "$OUT/ncu_decode.txt" 2>&1
      grep -E '^  [_a-z]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size|Warp Cycles Per Issued|Stall|One or More Eligible|Issued Warp' \
        "$OUT/ncu_decode.txt" | head -n 200
      for k in _w4a16_frag_kernel _dense_gemv_kernel _paged_decode_kernel; do
        "$ncu_bin" --import "$OUT/ncu_decode.ncu-rep" --page source --print-source sass --csv -k "$k" \
          --launch-count 1 > "$OUT/ncu_source_$k.csv" 2>&1 || echo "source page of $k: rc $?"
      done ;;
    profile-*)
      prec=${part#profile-}
      artifact "$prec"
      for c in ${PROFILE_CONCURRENCY:-64}; do
        python3 -m builder.bench.profile_step artifacts/llama3-8b-$prec --concurrency $c \
          --input-len ${PROFILE_INPUT_LEN:-128} 2>&1 \
          | tee "$OUT/profile_${prec}_c$c.txt" | grep -E '^\{|Self CUDA|^-|^ *[a-zA-Z_:]' | head -n 60
      done ;;
    hf|hf-compile)
      ckpt
      [ "$part" = hf ] && python3 -m builder.bench.hf_baseline $CKPT 2>&1 | grep '^{' | tee -a "$OUT/bench_8b.jsonl"
      python3 -m builder.bench.hf_baseline $CKPT --compile > "$OUT/hf_compile.log" 2>&1
      grep '^{' "$OUT/hf_compile.log" | tee -a "$OUT/bench_8b.jsonl" || tail -n 20 "$OUT/hf_compile.log" ;;
    train-candidates)
      unpack_corpus || { echo "$part: no .corpus/stdlib-*.tar.gz carried"; continue; }
      IFS='|' read -ra configs <<< "${TRAIN_CONFIGS:?set TRAIN_CONFIGS}"
      for i in "${!configs[@]}"; do
        python3 -m builder.devtools.train_bundled --out /tmp/cand-$i --tokenizer models/pystdlib-llama \
          --stdlib /tmp/stdlib --stdlib-version $version --device cuda ${configs[$i]} > /tmp/train_cand_$i.log 2>&1 &
      done
      wait
      for i in "${!configs[@]}"; do
        grep -E "perplexity|^done|Error" /tmp/train_cand_$i.log | tail -n 4 | sed "s/^/cand $i: /"
        python3 -m builder.devtools.train_draft --target /tmp/cand-$i --out /tmp/cand-$i-draft --stdlib /tmp/stdlib \
          --device cuda ${DRAFT_ARGS:-} > /tmp/train_draft_$i.log 2>&1 &
      done
      wait
      for i in "${!configs[@]}"; do
        tail -n 2 /tmp/train_draft_$i.log | sed "s/^/draft $i: /"
        for f in /tmp/train_cand_$i.log /tmp/train_draft_$i.log; do echo "=== $f ($(echo "${configs[$i]}"))"; cat $f; done \
          >> "$OUT/train_logs.txt"
        case " ${PACK_CANDIDATES:-${!configs[*]}} " in *" $i "*)
          tar -czf - -C /tmp cand-$i cand-$i-draft | split -b 15000000 -d - "$OUT/cand$i.tar.gz.part" ;; esac
      done
      if [ -n "${SPEC_CANDIDATE:-}" ] && [ -d /tmp/cand-$SPEC_CANDIDATE-draft ]; then
        rm -rf models/pystdlib-llama models/pystdlib-llama-draft artifacts/quickstart artifacts/quickstart-draft
        cp -r /tmp/cand-$SPEC_CANDIDATE models/pystdlib-llama
        cp -r /tmp/cand-$SPEC_CANDIDATE-draft models/pystdlib-llama-draft
        bash "$0" spec-draft
      fi ;;
    train-sweep|train-bundled)
      unpack_corpus || { echo "$part: no .corpus/stdlib-*.tar.gz carried"; continue; }
      corpus="--stdlib /tmp/stdlib --stdlib-version $version --device cuda"
      if [ $part = train-sweep ]; then
        IFS='|' read -ra configs <<< "${TRAIN_CONFIGS:?set TRAIN_CONFIGS}"
        for i in "${!configs[@]}"; do
          python3 -m builder.devtools.train_bundled --out /tmp/cand-$i --tokenizer models/pystdlib-llama $corpus \
            ${configs[$i]} > "$OUT/train_cand_$i.log" 2>&1 &
        done
        wait
        for i in "${!configs[@]}"; do
          python3 - /tmp/cand-$i "${configs[$i]}" <<'PY' | tee -a "$OUT/train_sweep.txt"
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
try:
    m = json.loads((d / "training_metrics.json").read_text())
except OSError:
    print(f"{sys.argv[2]}: no metrics (see its log)"); raise SystemExit
e, t = m["eval"], m["train"]
print(f"{sys.argv[2]}: {m['parameters']:,} params, {m['checkpoint_dir_bytes']:,} B, {t['epochs']:.1f} epochs, "
      f"{t['train_seconds']:.0f} s; ppl eval {e['eval_split_ppl']:.2f} calibration {e['calibration_split_ppl']:.2f} "
      f"eval.txt {e['eval_txt_ppl']:.2f}; validation curve {t.get('validation_curve')}")
print("  greedy:", json.dumps(m["samples"][0]["greedy"][:300]))
PY
        done
      else
        python3 -m builder.devtools.train_bundled --out models/pystdlib-llama --tokenizer models/pystdlib-llama \
          $corpus ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_bundled.log" | grep -E --line-buffered "perplexity|^done|Error"
        python3 -m builder.devtools.train_draft --target models/pystdlib-llama --out models/pystdlib-llama-draft \
          --stdlib /tmp/stdlib --device cuda ${DRAFT_ARGS:-} 2>&1 | tee "$OUT/train_draft.log" | tail -n 3
        tar -czf - models/pystdlib-llama models/pystdlib-llama-draft | split -b 15000000 -d - "$OUT/bundled.tar.gz.part"
      fi ;;
    spec-draft)
      for r in "" -draft; do
        [ -d artifacts/quickstart$r ] || python3 -m builder.cli build recipes/quickstart$r.yaml --quiet 2>&1 | tail -2
      done
      for k in ${SPEC_K:-2 4}; do
        python3 -m builder.bench.speculative artifacts/quickstart --device cuda --draft artifacts/quickstart-draft \
          --text models/pystdlib-llama/eval.txt --prompts ${SPEC_PROMPTS:-8} --num-draft $k --output-len 128 \
          --record "$OUT/benchmarks.jsonl" $( [ $k = 4 ] || echo --tag _k$k ) 2>&1 | tee -a "$OUT/spec_draft.log" \
          | grep -E '^\{|speedup|accept'
      done ;;
    tp-8b)
      ckpt
      for a in ${TP_ARTIFACTS:-bf16 bf16-tp2}; do
        [ -d artifacts/llama3-8b-$a ] || python3 -m builder.cli build recipes/bench/llama3-8b-$a.yaml --quiet 2>&1 \
          | tail -1 &
      done
      wait
      for a in ${TP_ARTIFACTS:-bf16 bf16-tp2}; do
        python3 -m builder.cli bench latency artifacts/llama3-8b-$a --input-len 128 --output-len 128 \
          --json "$OUT/lat_$a.jsonl" 2>&1 | grep '^{'
        bench throughput artifacts/llama3-8b-$a --input-len 128 --output-len 128 --concurrency 64
        if [ -n "${TP_EAGER-1}" ]; then
          bench latency artifacts/llama3-8b-$a --input-len 128 --output-len 128 --no-cuda-graphs
          bench throughput artifacts/llama3-8b-$a --input-len 128 --output-len 128 --concurrency 64 --no-cuda-graphs
        fi
      done
      if [ -f "$OUT/lat_bf16.jsonl" ] && [ -f "$OUT/lat_bf16-tp2.jsonl" ]; then
        python3 -m builder.devtools.tp_speedup --one "$OUT/lat_bf16.jsonl" --sharded "$OUT/lat_bf16-tp2.jsonl" \
          --tp-size 2 --name 8b --record "$OUT/benchmarks.jsonl" --command "builder bench latency \
artifacts/llama3-8b-{bf16,bf16-tp2} --input-len 128 --output-len 128 (gpu_suite.sh tp-8b)"
      fi
      for v in ${TP_ONE_SHOT_AB-}; do
        echo "== TP=2 with LLM_BUILDER_TP_ONE_SHOT_BYTES=$v"
        LLM_BUILDER_TP_ONE_SHOT_BYTES=$v bench latency artifacts/llama3-8b-bf16-tp2 --input-len 128 --output-len 128
        LLM_BUILDER_TP_ONE_SHOT_BYTES=$v bench throughput artifacts/llama3-8b-bf16-tp2 --input-len 128 \
          --output-len 128 --concurrency 64
      done ;;
    tp-check)
      timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_collectives.py -s 2>&1 | tail -30
      for tp in 1 2; do
        python3 -m builder.cli build recipes/quickstart.yaml --quiet --set output_dir=/tmp/tpc/qs-tp$tp \
          --set parallel.tp_size=$tp 2>&1 | tail -1
      done
      timeout -k 10 300 python3 -m builder.devtools.tp_check /tmp/tpc/qs-tp1 /tmp/tpc/qs-tp2 --device cuda 2>&1 | grep -v "^\[" | tail -6
      python3 -m builder.devtools.make_checkpoint --preset tiny-moe --out /tmp/tpc/tiny-moe 2>&1 | tail -1
      # fp32: the sharding checked tightly (on the CPU, gloo: 256/256 tokens, max |logit difference| 2.4e-7); bf16
      # sums split over the ranks round differently (CPU: 156/256, 4.3e-3 on the random model's near ties); FP8
      # quantizes each rank's half of a row-parallel input per token
      for prec in fp32 bf16 fp8; do
        recipe=$prec; dtype=""; [ $prec = fp32 ] && { recipe=bf16; dtype="--set model.dtype=float32"; }
        for tp in 1 2; do
          python3 -m builder.cli build recipes/bench/qwen3-30b-a3b-$recipe.yaml --quiet $dtype \
            --set model.checkpoint=/tmp/tpc/tiny-moe --set output_dir=/tmp/tpc/moe-$prec-tp$tp \
            --set runtime.max_seq_len=512 --set runtime.max_batch_size=8 --set runtime.max_num_tokens=512 \
            --set parallel.tp_size=$tp 2>&1 | tail -1
        done
        echo "== tiny MoE $prec, tp_size 2 against 1"
        timeout -k 10 300 python3 -m builder.devtools.tp_check /tmp/tpc/moe-$prec-tp1 /tmp/tpc/moe-$prec-tp2 --device cuda 2>&1 \
          | grep -v "^\[" | tail -6
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
