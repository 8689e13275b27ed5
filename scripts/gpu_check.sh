#!/usr/bin/env bash
# The CUDA-only checks in one go (DESIGN §4), sized for the lent machine (one H200, at most
# 8 files back, 10 minutes a command): the whole run ends within the budget (540 s unless
# --budget S), a step starts only if its timeout still fits, the first hang ends the run
# with every Python thread's stack in the summary. CI never runs this (no GPU there).
#   bash scripts/gpu_check.sh [--plan] [--budget S] [--only A,B] [--gpus N]
# Results: ${OUT:-gpu-check}/summary.json (each step's status pass/fail/skip/timeout,
# seconds, numbers, last log lines, a failure's log tail), the fp32 DHelix Chrome trace
# (trace.rank0.json, trace.rank0.png), hang.log and up to 3 fail-*.log. Logs stay in a /tmp folder.
# On the lent machine: run scripts/gpu_prep.sh here first (wheels in .whl/, Megatron-LM's
# training code in .megatron-lm/), then one device call with carry [".whl", ".megatron-lm"]
# and the command `bash scripts/gpu_check.sh`: the `setup` step installs them there.
# The steps, in the order that protects the one number that matters (`--plan` prints them
# with the worst case; docs/gpu-check.md has the expected seconds of each):
#   setup        the carried wheels into $SITE (PYTHONPATH), `pip install -e .` (C++ planner)
#   lanes        CudaLanes on a one-rank NCCL group at CUDA_DEVICE_MAX_CONNECTIONS=1 (what
#                every `dhelix train` sets): each collective's input freed and overwritten
#                on the compute stream while a _sleep holds the lane stream, with the lane's
#                keep dropped so only record_stream protects it (a control shows the check
#                can fire); and overlap: a lane's work beside a GEMM loop takes about the
#                longer of the two, not their sum (scripts/gpu_lanes_check.py)
#   fp32/*       DHelix ≡ megatron on CUDA, fp32, TP=1: losses, every step's per-parameter
#                gradient sums and sums of squares, the final weights, gated at 1e-5
#   timing/*     an 8-layer Llama-3-8B-shaped GPT, bf16, seq 4096, micro-batch 1, 8
#                micro-batches: DHelix's tokens/s and activation peak beside megatron's on
#                the same spec; the goals gate (TP=1, nothing to hide: >= 0.97x the speed,
#                <= 1.05x the memory)
#   distopt/*    the distributed optimizer with --overlap-grad-reduce --overlap-param-gather
#   recompute/*  full recompute (uniform, 1 layer) with hidden and attention dropout 0.1:
#                the recomputed forward must redraw the same masks
#   extras, only while the budget lasts, most telling first: save at 5 and resume to 10
#                against 10 straight; --dhelix on tiny-moe; --fp16 (dynamic loss scale);
#                selective recompute with dropout; Megatron-LM's own pretrain_gpt.py without
#                and with --dhelix and with DHelix's kernels alone (--dhelix-sdpa-baseline),
#                torch.compile off on all three (scripts/gpu_megatron_lm.sh); bf16; the
#                intra-batch peer; megatron's unfused local layer; with >= 2 GPUs TP=2+SP,
#                PP=2 (the fold), EP=2, CP=2 over NCCL (on the lent machine: skipped, NCCL
#                refuses two ranks on one GPU)
# A timed-out step (hung, or only slow) skips what needs it (after=), not the rest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
if compgen -G ".whl/*.whl" >/dev/null; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi

if [ "${1:-}" = "--setup" ]; then       # the plan's first step
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || exit 1
  fi
  if ! python3 -c "import dhelix._planner_core" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  fi
  exec python3 -c "import torch, megatron.core as m, dhelix._planner_core; print('torch',
torch.__version__, '| megatron-core', m.__version__, '| CUDA', torch.version.cuda,
torch.cuda.device_count(), 'GPU(s)', torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
fi

DH="python3 -m dhelix.cli train --data synthetic --log-interval 5"
export FP32="$DH --config tiny-llama --train-iters 10 --micro-batch-size 2 --global-batch-size 8 --seq-length 128 --checksums"
export BIG="$DH --config llama3-8b-8l --train-iters 12 --micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16 --log-interval 4"
export MOE="$DH --config tiny-moe --train-iters 10"
export PP="$DH --config tiny-llama4 --micro-batch-size 1 --global-batch-size 8 --train-iters 10"
ML="ML_TIMEOUT=0 LOGDIR=\$T bash scripts/gpu_megatron_lm.sh"
DROP="cp configs/models/tiny-llama.yaml \$T/drop.yaml && printf 'hidden_dropout: 0.1\\nattention_dropout: 0.1\\n' >> \$T/drop.yaml &&"
RECOMPUTE="--config \$T/drop.yaml --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
DISTOPT="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
# NAME | TIMEOUT_S | OPTIONS | COMMAND     ($T: scratch outside $OUT; '-': a builtin, no timeout)
PLAN="
setup              | 45 | required gpus=0 | bash scripts/gpu_check.sh --setup
lanes              | 40 |                 | CUDA_DEVICE_MAX_CONNECTIONS=1 python3 scripts/gpu_lanes_check.py
fp32/base          | 30 |                 | \$FP32 --json \$T/fp32-base.json
fp32/dhelix        | 30 | keep=trace.rank0.json,trace.rank0.png | \$FP32 --dhelix --json \$T/fp32-dhelix.json --dhelix-trace \$T/trace.json
fp32/compare       | -  | after=fp32/base,fp32/dhelix | @compare \$T/fp32-base.json \$T/fp32-dhelix.json 1e-5
timing/base        | 75 |                 | \$BIG --json \$T/big-base.json
timing/dhelix      | 75 |                 | \$BIG --dhelix --json \$T/big-dhelix.json
timing/compare     | -  | after=timing/base,timing/dhelix | @compare \$T/big-base.json \$T/big-dhelix.json 5e-2 timing
distopt/base       | 30 |                 | \$FP32 $DISTOPT --json \$T/distopt-base.json
distopt/dhelix     | 30 |                 | \$FP32 $DISTOPT --dhelix --json \$T/distopt-dhelix.json
distopt/compare    | -  | after=distopt/base,distopt/dhelix | @compare \$T/distopt-base.json \$T/distopt-dhelix.json 1e-5
recompute/base     | 30 |                 | $DROP \$FP32 $RECOMPUTE --json \$T/recompute-base.json
recompute/dhelix   | 30 |                 | $DROP \$FP32 $RECOMPUTE --dhelix --json \$T/recompute-dhelix.json
recompute/compare  | -  | after=recompute/base,recompute/dhelix | @compare \$T/recompute-base.json \$T/recompute-dhelix.json 1e-5
# extras: each runs only if its timeout still fits the running budget
resume/straight    | 30 | extra | \$FP32 --dhelix --save \$T/ck --save-interval 5 --json \$T/resume-straight.json
resume/cut         | 10 | extra after=resume/straight | mkdir -p \$T/ck-cut && cp -r \$T/ck/iter_0000005 \$T/ck-cut/ && echo 5 > \$T/ck-cut/latest_checkpointed_iteration.txt
resume/resumed     | 30 | extra after=resume/cut | \$FP32 --dhelix --load \$T/ck-cut --json \$T/resume-resumed.json
resume/compare     | -  | extra after=resume/straight,resume/resumed | @compare-resumed \$T/resume-straight.json \$T/resume-resumed.json 1e-5
moe/base           | 30 | extra | \$MOE --checksums --json \$T/moe-base.json
moe/dhelix         | 30 | extra | \$MOE --checksums --dhelix --json \$T/moe-dhelix.json
moe/compare        | -  | extra after=moe/base,moe/dhelix | @compare \$T/moe-base.json \$T/moe-dhelix.json 1e-5
fp16/base          | 30 | extra | \$FP32 --fp16 --json \$T/fp16-base.json
fp16/dhelix        | 30 | extra | \$FP32 --fp16 --dhelix --json \$T/fp16-dhelix.json
fp16/compare       | -  | extra after=fp16/base,fp16/dhelix | @compare \$T/fp16-base.json \$T/fp16-dhelix.json 1e-5
selective/base     | 30 | extra | $DROP \$FP32 --config \$T/drop.yaml --recompute-granularity selective --json \$T/selective-base.json
selective/dhelix   | 30 | extra | $DROP \$FP32 --config \$T/drop.yaml --recompute-granularity selective --dhelix --json \$T/selective-dhelix.json
selective/compare  | -  | extra after=selective/base,selective/dhelix | @compare \$T/selective-base.json \$T/selective-dhelix.json 1e-5
megatron-lm/base   | 60 | extra | $ML megatron
megatron-lm/dhelix | 60 | extra | $ML dhelix
megatron-lm/compare| -  | extra after=megatron-lm/base,megatron-lm/dhelix | @compare-logs \$T/megatron-lm-megatron.log \$T/megatron-lm-dhelix.log 2e-2
megatron-lm/sdpa   | 60 | extra | $ML sdpa
megatron-lm/same-kernels | - | extra after=megatron-lm/sdpa,megatron-lm/dhelix | @compare-logs \$T/megatron-lm-sdpa.log \$T/megatron-lm-dhelix.log 1e-4
bf16/base          | 40 | extra | \$FP32 --bf16 --json \$T/bf16-base.json
bf16/dhelix        | 40 | extra | \$FP32 --bf16 --dhelix --json \$T/bf16-dhelix.json
bf16/compare       | -  | extra after=bf16/base,bf16/dhelix | @compare \$T/bf16-base.json \$T/bf16-dhelix.json 2e-2
peer/fp32          | 40 | extra | \$FP32 --dhelix-peer intra-batch --json \$T/fp32-peer.json
peer/compare       | -  | extra after=fp32/base,peer/fp32 | @compare \$T/fp32-base.json \$T/fp32-peer.json 1e-5
timing/local       | 75 | extra | \$BIG --layer-spec megatron-local --json \$T/big-local.json
tp2/base           | 90 | extra gpus=2 | \$FP32 --nproc 2 --tensor-model-parallel-size 2 --sequence-parallel --json \$T/tp2-base.json
tp2/dhelix         | 90 | extra gpus=2 | \$FP32 --nproc 2 --tensor-model-parallel-size 2 --sequence-parallel --dhelix --json \$T/tp2-dhelix.json
tp2/compare        | -  | extra after=tp2/base,tp2/dhelix | @compare \$T/tp2-base.json \$T/tp2-dhelix.json 1e-5
pp2/init           | 60 | extra gpus=2 | \$PP --train-iters 0 --save \$T/pp-init
pp2/1f1b           | 90 | extra gpus=2 after=pp2/init | \$PP --nproc 2 --pipeline-model-parallel-size 2 --load \$T/pp-init --json \$T/pp-1f1b.json
pp2/fold           | 90 | extra gpus=2 after=pp2/init | \$PP --nproc 2 --pipeline-model-parallel-size 2 --load \$T/pp-init --dhelix --dhelix-fold --json \$T/pp-fold.json
pp2/compare        | -  | extra after=pp2/1f1b,pp2/fold | @compare \$T/pp-1f1b.json \$T/pp-fold.json 1e-5
ep2/base           | 90 | extra gpus=2 | \$MOE --nproc 2 --expert-model-parallel-size 2 --json \$T/moe-ep2.json
cp2/base           | 90 | extra gpus=2 | \$FP32 --nproc 2 --context-parallel-size 2 --json \$T/cp2-base.json
cp2/dhelix         | 90 | extra gpus=2 | \$FP32 --nproc 2 --context-parallel-size 2 --dhelix --json \$T/cp2-dhelix.json
cp2/compare        | -  | extra after=cp2/base,cp2/dhelix | @compare \$T/cp2-base.json \$T/cp2-dhelix.json 1e-5
"
exec python3 scripts/gpu_check_run.py run --budget "${GPU_CHECK_BUDGET:-540}" "$@" <<<"$PLAN"
