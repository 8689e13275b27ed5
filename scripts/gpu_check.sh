#!/usr/bin/env bash
# The CUDA-only checks in one go (DESIGN §4), for a machine with one or more GPUs.
# CI never runs this (no GPU there). Run from the repo root after `pip install -e .`
# with a CUDA torch; results land in ${OUT:-gpu-check}/.
#   1. DHelix ≡ megatron on CUDA (fp32): losses of 10 steps, one process (TP=1; the
#      CudaLanes compute path, autograd's device thread, the CUDA allocator's peak);
#   2. the same in bf16 (losses close, not equal: bf16 GEMM order may differ);
#   3. with ≥2 GPUs: TP=2 + SP over NCCL (CudaLanes' comm streams), DHelix ≡ megatron;
#   4. timings of baseline vs DHelix on a larger model, side by side.
set -euo pipefail
out="${OUT:-gpu-check}"; mkdir -p "$out"
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $ngpu"
run() { dhelix train --data synthetic --log-interval 5 "$@"; }
compare() {  # compare A.json B.json TOL
python - "$1" "$2" "$3" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol = float(sys.argv[3])
worst = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
print(f"  losses max rel diff {worst:.2e} (tol {tol}) | tokens/s {a['tokens_per_s']:.0f} -> "
      f"{b['tokens_per_s']:.0f} ({b['tokens_per_s'] / a['tokens_per_s']:.2f}x) | peak mem "
      f"{a['peak_memory_bytes'] / 2**20:.1f} -> {b['peak_memory_bytes'] / 2**20:.1f} MiB "
      f"({b['peak_memory_bytes'] / a['peak_memory_bytes']:.3f}x)")
sys.exit(0 if worst <= tol else 1)
PY
}
common=(--config tiny-llama --train-iters 10 --micro-batch-size 2 --global-batch-size 8 --seq-length 128)
echo "== 1. fp32, 1 GPU"; run "${common[@]}" --json "$out/fp32-base.json"
run "${common[@]}" --dhelix --json "$out/fp32-dhelix.json" --dhelix-trace "$out/trace.json"
compare "$out/fp32-base.json" "$out/fp32-dhelix.json" 1e-5
echo "== 2. bf16, 1 GPU"; run "${common[@]}" --bf16 --json "$out/bf16-base.json"
run "${common[@]}" --bf16 --dhelix --json "$out/bf16-dhelix.json"
compare "$out/bf16-base.json" "$out/bf16-dhelix.json" 2e-2
if [ "$ngpu" -ge 2 ]; then
  echo "== 3. TP=2 + SP over NCCL"
  tp=(--nproc 2 --tensor-model-parallel-size 2 --sequence-parallel)
  run "${common[@]}" "${tp[@]}" --json "$out/tp2-base.json"
  run "${common[@]}" "${tp[@]}" --dhelix --json "$out/tp2-dhelix.json"
  compare "$out/tp2-base.json" "$out/tp2-dhelix.json" 1e-5
fi
echo "== 4. timing (base model, bf16, seq 1024)"
big=(--config base --train-iters 20 --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --bf16)
[ "$ngpu" -ge 2 ] && big+=(--nproc "$ngpu" --tensor-model-parallel-size "$ngpu" --sequence-parallel)
run "${big[@]}" --json "$out/big-base.json"
run "${big[@]}" --dhelix --json "$out/big-dhelix.json"
compare "$out/big-base.json" "$out/big-dhelix.json" 1  # timing only
echo "gpu check: all comparisons passed; files in $out/"
