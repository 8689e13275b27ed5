#!/usr/bin/env bash
# DHelix's equivalence set on another megatron-core release (CI: 0.19.2, after the whole
# suite on the pip-installed 0.16.1).
#   bash scripts/test_megatron_core.sh [VERSION] [pytest arguments ...]
# Every layout's `--dhelix` ≡ megatron bit for bit (dense TP+SP with random plans, TP×DP,
# MoE EP, CP, the fold, CP×PP, the distributed optimizer, recompute, exact resume), the
# spec and install hook, and Megatron-LM's training code of the paired tag
# (`$MEGATRON_LM`, default ../shared/megatron-lm-0.19 for 0.19.x): its parser, builder and
# schedule with and without --dhelix, and checkpoints both ways.
# On Python >= 3.12 the installed megatron-core must be VERSION (pip install
# megatron-core==VERSION). On older Pythons, where pip offers no release after 0.16.1,
# scripts/install_megatron_core.py puts the published wheel in .mcore-VERSION/, first on
# PYTHONPATH for this run only. DHELIX_EXPECT_MCORE makes every process check the release
# it imported (dhelix/compat/mcore.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
V=${1:-0.19.2}
[ $# -gt 0 ] && shift
if python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  have=$(python3 -c 'from megatron.core import package_info as p; print(p.__shortversion__)')
  [ "$have" = "$V" ] || { echo "test_megatron_core: megatron-core $have is installed, not $V: pip install megatron-core==$V" >&2; exit 2; }
else
  python3 scripts/install_megatron_core.py "$V"
  export PYTHONPATH="$PWD/.mcore-$V${PYTHONPATH:+:$PYTHONPATH}"
fi
export DHELIX_EXPECT_MCORE=$V
case "$V" in
  0.19.*) export MEGATRON_LM=${MEGATRON_LM:-$(cd .. && pwd)/shared/megatron-lm-0.19} ;;
  *)      export MEGATRON_LM=${MEGATRON_LM:-$(cd .. && pwd)/shared/megatron-lm} ;;
esac
# One or two equivalence tests of each layout and feature (the whole files run on 0.16.1;
# this set: 63 tests, about 6 minutes on 2 cores, two at a time; the stop-and-resume path
# is Megatron-LM's signal handler in test_megatron_lm.py and exact resume in test_checkpoint)
SET=(
  tests/test_one_spec.py tests/test_megatron.py
  tests/test_strand.py::test_random_plans_match_megatron
  tests/test_strand.py::test_layer_node_matches_megatron
  "tests/test_schedule.py::test_tp2_sp_matches_baseline[8]"
  "tests/test_schedule.py::test_tp2_dp2_matches_baseline[3-1]"
  "tests/test_schedule.py::test_random_plans_train_like_baseline[1]"
  tests/test_moe.py::test_dhelix_moe_layer_matches_megatron
  tests/test_moe.py::test_dhelix_moe_training_matches_the_baseline
  tests/test_strict_moe.py::test_dhelix_moe_layer_tp2_ep2_matches_megatron_in_strict_mode
  tests/test_context_parallel.py::test_dhelix_equals_cp_baseline_for_random_plans
  "tests/test_folding.py::test_fold_trains_like_megatron_1f1b[pp2-tp2sp-mb4]"
  "tests/test_folding.py::test_fold_trains_like_megatron_1f1b[pp2-mb4-tied]"
  tests/test_cp_pp.py::test_cp2_pp2_fold_trains_like_1f1b
  tests/test_cp_pp.py::test_ep2_pp2_fold_trains_like_1f1b
  "tests/test_pair_last.py::test_pair_last_matches_megatron_for_random_plans[4]"
  tests/test_optimizer.py::test_distributed_optimizer_dhelix_matches_megatron
  tests/test_optimizer.py::test_bf16_dhelix_matches_megatron
  tests/test_optimizer.py::test_fp16_loss_scaling_dhelix_matches_megatron
  tests/test_recompute.py::test_dhelix_recompute_matches_megatron_recompute
  tests/test_recompute.py::test_recompute_with_dropout_replays_the_masks
  tests/test_checkpoint.py::test_resume_is_exact
  tests/test_megatron_lm.py tests/test_checkpoint_megatron_lm.py
  tests/test_mcore_versions.py::test_no_deprecation_notice_from_dhelix_spec
)
echo "test_megatron_core: megatron-core $V, Megatron-LM training code at $MEGATRON_LM"
exec python3 -m pytest -q -p no:cacheprovider --timeout=900 "${SET[@]}" "$@"
