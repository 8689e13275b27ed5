#!/usr/bin/env bash
# The CUDA-only checks in one go (DESIGN §4), for a machine with one or more GPUs.
# CI never runs this (no GPU there). Run from the repo root after `pip install -e .` with a
# CUDA torch; results land in ${OUT:-gpu-check}/. Every run has its own timeout; a hang is
# aborted with SIGABRT, so PYTHONFAULTHANDLER=1 prints every thread's stack.
#   1. DHelix ≡ megatron on CUDA, fp32, one process (TP=1): CudaLanes' compute path, the
#      CUDA autograd engine's device thread (the old design deadlocked here), the
#      allocator's peak; gradient and weight checksums compared too.
#   2. the same in bf16 (close, not equal) and the intra-batch peer;
#   3. with ≥2 GPUs: TP=2 + SP over NCCL (CudaLanes' comm streams), DHelix ≡ megatron;
#   4. the timing row: an 8-layer Llama-3-8B-shaped GPT, bf16, seq 4096, micro-batch 1,
#      8 micro-batches; DHelix's tokens/s and peak memory beside megatron's (goal with
#      TP=1, where there is no comm to hide: ≥ 0.97x the speed, ≤ 1.05x the memory);
#   5. Megatron-LM's own pretrain_gpt.py with and without --dhelix (scripts/gpu_megatron_lm.sh).
set -uo pipefail
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
out="${OUT:-gpu-check}"; mkdir -p "$out"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $ngpu ($(python3 -c "import torch; print(torch.cuda.get_device_name())"))"
fails=0
run() {  # run LIMIT_S ARGS...: one dhelix train with its own timeout
  local limit=$1; shift
  timeout -s SIGABRT "$limit" dhelix train --data synthetic --log-interval 5 "$@" \
    || { echo "  FAILED (exit $?): dhelix train $*"; fails=$((fails + 1)); return 1; }
}
compare() {  # compare A.json B.json TOL [timing]
python3 - "$@" <<'PY' || fails=$((fails + 1))
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol, timing = float(sys.argv[3]), len(sys.argv) > 4
worst = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
gw = 0.0
for ga, gb in zip(a.get("grad_checksums", []), b.get("grad_checksums", [])):
    for n in ga:
        (s1, q1), (s2, q2) = ga[n], gb[n]
        gw = max(gw, abs(q1 - q2) / max(q1, 1e-30))
speed = b["tokens_per_s"] / a["tokens_per_s"]
mem = b["peak_memory_bytes"] / a["peak_memory_bytes"]
print(f"  losses max rel diff {worst:.2e} (tol {tol:g}) | grad sum-of-squares max rel diff "
      f"{gw:.2e} | tokens/s {a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f} ({speed:.3f}x) "
      f"| peak mem {a['peak_memory_bytes'] / 2**30:.2f} -> {b['peak_memory_bytes'] / 2**30:.2f}"
      f" GiB ({mem:.3f}x)")
if timing:
    print(f"  goal (TP=1): speed >= 0.97x: {'met' if speed >= 0.97 else 'MISSED'}; "
          f"memory <= 1.05x: {'met' if mem <= 1.05 else 'MISSED'}")
sys.exit(0 if worst <= tol else 1)
PY
}
common=(--config tiny-llama --train-iters 10 --micro-batch-size 2 --global-batch-size 8
        --seq-length 128 --checksums)
echo "== 1. fp32, 1 GPU: DHelix ≡ megatron"
run 120 "${common[@]}" --json "$out/fp32-base.json"
run 120 "${common[@]}" --dhelix --json "$out/fp32-dhelix.json" --dhelix-trace "$out/trace.json" \
  && compare "$out/fp32-base.json" "$out/fp32-dhelix.json" 1e-5
echo "== 2. bf16, 1 GPU; the intra-batch peer"
run 120 "${common[@]}" --bf16 --json "$out/bf16-base.json"
run 120 "${common[@]}" --bf16 --dhelix --json "$out/bf16-dhelix.json" \
  && compare "$out/bf16-base.json" "$out/bf16-dhelix.json" 2e-2
run 120 "${common[@]}" --dhelix-peer intra-batch --json "$out/fp32-peer.json" \
  && compare "$out/fp32-base.json" "$out/fp32-peer.json" 1e-5
if [ "$ngpu" -ge 2 ]; then
  echo "== 3. TP=2 + SP over NCCL"
  tp=(--nproc 2 --tensor-model-parallel-size 2 --sequence-parallel)
  run 180 "${common[@]}" "${tp[@]}" --json "$out/tp2-base.json"
  run 180 "${common[@]}" "${tp[@]}" --dhelix --json "$out/tp2-dhelix.json" \
    && compare "$out/tp2-base.json" "$out/tp2-dhelix.json" 1e-5
  echo "== 3b. PP=2: the DHelix fold ≡ megatron 1F1B over NCCL (one PP=1 checkpoint)"
  pp=(--config tiny-llama4 --micro-batch-size 1 --global-batch-size 8 --train-iters 10)
  run 120 "${pp[@]}" --train-iters 0 --save "$out/pp-init"
  run 180 "${pp[@]}" --nproc 2 --pipeline-model-parallel-size 2 --load "$out/pp-init" \
    --json "$out/pp-1f1b.json"
  run 180 "${pp[@]}" --nproc 2 --pipeline-model-parallel-size 2 --load "$out/pp-init" \
    --dhelix --dhelix-fold --json "$out/pp-fold.json" \
    && compare "$out/pp-1f1b.json" "$out/pp-fold.json" 1e-5
  echo "== 3c. MoE, EP=2 over NCCL (megatron's MoE block; the baseline only)"
  run 180 --config tiny-moe --nproc 2 --expert-model-parallel-size 2 --train-iters 10 \
    --json "$out/moe-ep2.json"
  echo "== 3e. CP=2: ring attention over NCCL (batched P2P on the lane stream); DHelix ≡ baseline"
  cpa=(--config tiny-llama --nproc 2 --context-parallel-size 2 --seq-length 128 --train-iters 10)
  run 180 "${cpa[@]}" --json "$out/cp2-base.json"
  run 180 "${cpa[@]}" --dhelix --json "$out/cp2-dhelix.json" \
    && compare "$out/cp2-base.json" "$out/cp2-dhelix.json" 1e-5
else
  echo "== 3. skipped: TP=2, PP=2 (the fold), EP=2 and CP=2 need 2 GPUs (NCCL refuses two ranks on one)"
fi
echo "== 3d. MoE on 1 GPU (megatron's MoE block, no Transformer Engine needed)"
run 120 --config tiny-moe --train-iters 10 --json "$out/moe-1gpu.json"
echo "== 4. timing: 8-layer Llama-3-8B shape, bf16, seq 4096, mbs 1, 8 micro-batches"
big=(--config llama3-8b-8l --train-iters 12 --micro-batch-size 1 --global-batch-size 8
     --seq-length 4096 --bf16 --log-interval 4)
run 300 "${big[@]}" --json "$out/big-base.json"
run 300 "${big[@]}" --dhelix --json "$out/big-dhelix.json" \
  && compare "$out/big-base.json" "$out/big-dhelix.json" 1 timing
echo "== 5. Megatron-LM's pretrain_gpt.py, with and without --dhelix (20 iterations, TP=1)"
if [ -f "${MEGATRON_LM:-../shared/megatron-lm}/pretrain_gpt.py" ]; then
  OUT="$out" bash scripts/gpu_megatron_lm.sh || fails=$((fails + 1))
else
  echo "  skipped: no Megatron-LM checkout (set MEGATRON_LM)"
fi
echo "gpu check: $fails failure(s); files in $out/"
exit $((fails > 0))
