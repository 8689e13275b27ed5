#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on one GPU, with and without --dhelix (TP=1, mock
# data, 20 iterations, bf16), and the logged losses compared.
#   bash scripts/gpu_megatron_lm.sh [both|megatron|sdpa|dhelix]      (default: both + compare)
# Needs a CUDA torch, megatron-core (0.19.2 or 0.16.1), Megatron-LM's training code of the
# pairing tag (core_v0.19.0 or core_v0.16.1) and its small
# packages (pip install -e ".[megatron-lm]": six, regex, triton, pydantic). The training
# code is found at $MEGATRON_LM, else ./.megatron-lm (the copy scripts/gpu_prep.sh makes,
# carried to the lent GPU machine), else ../shared/megatron-lm (tag core_v0.16.1); none:
# exit 77 (skipped). Flags for a machine without apex and Transformer Engine:
# --no-gradient-accumulation-fusion (apex/TE's fused wgrad), --no-masked-softmax-fusion
# (compiled softmax kernels), --no-persist-layer-norm (apex). megatron-core's wheel
# carries its dataset helper prebuilt but not the Makefile that Megatron-LM's
# `compile_helpers` runs `make` on: with no Makefile there, that step becomes an import of
# the prebuilt helper (printed). Logs: ${LOGDIR:-${OUT:-gpu-check}}/megatron-lm-NAME.log.
# Each run has a timeout of ML_TIMEOUT s (default 400; 0: none, for a caller that times
# the whole script: scripts/gpu_check.sh does, and SIGABRTs the process group).
# torch.compile is off (TORCHDYNAMO_DISABLE=1) in every mode alike: megatron-core wraps its
# fused activations and bias-dropout-adds in torch.compile, whose first compiles on a fresh
# machine would eat the GPU check's budget; eager kernels cost both sides the same.
set -uo pipefail
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -n "${MEGATRON_LM:-}" ]; then ML=$MEGATRON_LM
elif [ -f .megatron-lm/pretrain_gpt.py ]; then ML=.megatron-lm
else ML=../shared/megatron-lm; fi
logdir="${LOGDIR:-${OUT:-gpu-check}}"; mkdir -p "$logdir"
[ -f "$ML/pretrain_gpt.py" ] || {
  echo "skip: no Megatron-LM checkout at $ML (run scripts/gpu_prep.sh, or set MEGATRON_LM)"; exit 77; }
args=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
      --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16
      --train-iters 20 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --mock-data
      --tokenizer-type NullTokenizer --vocab-size 32000 --transformer-impl local
      --log-interval 1 --eval-iters 0 --split 1,0,0 --seed 1234 --bf16
      --attention-dropout 0 --hidden-dropout 0 --distributed-backend nccl
      --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm)
run() {  # run NAME EXTRA...: one single-GPU pretrain_gpt.py (through the DHelix wrapper)
  local name=$1; shift
  local log="$logdir/megatron-lm-$name.log" t=()
  [ "${ML_TIMEOUT:-400}" != 0 ] && t=(timeout -s SIGABRT "${ML_TIMEOUT:-400}")
  echo "== Megatron-LM pretrain_gpt.py ($name), checkout $ML, log $log"
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + RANDOM % 1000)) RANK=0 WORLD_SIZE=1 \
  LOCAL_RANK=0 ${t[@]+"${t[@]}"} python3 - "$ML" scripts/pretrain_gpt_dhelix.py --megatron-lm "$ML" \
      "${args[@]}" "$@" <<'PY' 2>&1 | tee "$log"
import os, runpy, sys
ml, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, ml)
import megatron.core.datasets as ds
import megatron.core.datasets.utils as du
if not os.path.exists(os.path.join(os.path.dirname(ds.__file__), "Makefile")):
    def compile_helpers():   # the wheel's prebuilt helper stands in for `make`
        import megatron.core.datasets.helpers_cpp as h
        print(f"> dataset helper: prebuilt {os.path.basename(h.__file__)} (no Makefile)")
    du.compile_helpers = compile_helpers
from torch.utils import cpp_extension
if cpp_extension.CUDA_HOME is None:   # fused_kernels.load only reads `nvcc -V` (builds none)
    try:                                # megatron.legacy: core_v0.16.1's code only
        import megatron.legacy.fused_kernels as fk
        fk.load = lambda args: print("> fused kernels: none built (no CUDA_HOME)")
    except ImportError:
        pass
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
PY
  local rc=$?
  echo "  $name: exit $rc"
  return $rc
}
case "${1:-both}" in
  megatron) run megatron ;;
  sdpa) run sdpa --dhelix-sdpa-baseline ;;      # megatron's layer on DHelix's kernels
  dhelix) run dhelix --dhelix ;;
  both)
    run megatron; a=$?
    run dhelix --dhelix; b=$?
    python3 scripts/gpu_check_run.py compare-logs "$logdir/megatron-lm-megatron.log" \
      "$logdir/megatron-lm-dhelix.log" 2e-2 && [ $a = 0 ] && [ $b = 0 ] ;;
  *) echo "usage: $0 [both|megatron|sdpa|dhelix]" >&2; exit 2 ;;
esac
