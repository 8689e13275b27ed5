#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on one GPU, with and without --dhelix (TP=1, mock
# data, 20 iterations), and the logged losses compared. Needs a CUDA torch, megatron-core
# 0.16.1, a Megatron-LM checkout ($MEGATRON_LM, default ../shared/megatron-lm, tag
# core_v0.16.1) and its extra packages (pip install -e ".[megatron-lm]"). Run by
# scripts/gpu_check.sh; results in ${OUT:-gpu-check}/megatron-lm-*.log.
set -uo pipefail
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
ML=${MEGATRON_LM:-../shared/megatron-lm}
out="${OUT:-gpu-check}"; mkdir -p "$out"
[ -f "$ML/pretrain_gpt.py" ] || { echo "no Megatron-LM checkout at $ML (set MEGATRON_LM)"; exit 2; }
args=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
      --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16
      --train-iters 20 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --mock-data
      --tokenizer-type NullTokenizer --vocab-size 32000 --transformer-impl local
      --log-interval 1 --eval-iters 0 --split 1,0,0 --seed 1234 --bf16
      --attention-dropout 0 --hidden-dropout 0 --distributed-backend nccl)
run() {  # run NAME EXTRA...: one single-GPU pretrain_gpt.py under its own timeout
  local name=$1; shift
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + RANDOM % 1000)) RANK=0 WORLD_SIZE=1 \
  LOCAL_RANK=0 timeout -s SIGABRT 400 python3 scripts/pretrain_gpt_dhelix.py \
      --megatron-lm "$ML" "${args[@]}" "$@" > "$out/megatron-lm-$name.log" 2>&1
  echo "  $name: exit $? (log $out/megatron-lm-$name.log)"
}
run megatron
run dhelix --dhelix
python3 - "$out/megatron-lm-megatron.log" "$out/megatron-lm-dhelix.log" <<'PY'
import re, sys
def losses(path):
    return [float(m) for m in re.findall(r"lm loss: ([0-9.Ee+-]+)", open(path).read())]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print(f"  iterations logged: megatron {len(a)}, dhelix {len(b)}")
if not a or len(a) != len(b):
    sys.exit("  FAILED: missing iterations")
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"  lm loss, first/last: megatron {a[0]:.5f}/{a[-1]:.5f}, dhelix {b[0]:.5f}/{b[-1]:.5f};"
      f" max rel diff {worst:.2e} (bf16; tolerance 2e-2)")
sys.exit(0 if worst <= 2e-2 else 1)
PY
