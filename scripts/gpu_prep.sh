#!/usr/bin/env bash
# Prepare a device run of scripts/gpu_check.sh (run HERE, on the machine with the network,
# from anywhere in the checkout). The lent GPU machine has no network and no megatron-core,
# and Megatron-LM's training code (../shared/megatron-lm) does not travel with the checkout,
# so this puts both into git-ignored folders of the repo root that the device call carries:
#   .whl/          megatron-core (MCORE, default 0.19.2, what users run today; MCORE=0.16.1
#                  for the other tested release) built for Python 3.12, and the small packages
#                  Megatron-LM's training code imports that the device image lacks
#                  (pydantic and its needs; six, regex, triton, einops are there already)
#   .megatron-lm/  pretrain_gpt.py, gpt_builders.py, model_provider.py and every package
#                  of megatron/ but core (training, post_training, rl, and legacy at
#                  core_v0.16.1, inference and elastification at core_v0.19.0;
#                  megatron/core comes from the wheel), about 2 MB
# Then it prints the carry list and the device command. Re-running replaces both folders.
# MEGATRON_LM names another Megatron-LM checkout (tag core_v0.19.0 pairs with 0.19.2,
# core_v0.16.1 with 0.16.1; the default is ../shared's copy of the pairing tag).
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
MCORE=${MCORE:-0.19.2}
case "$MCORE" in
  0.19.*) ML=${MEGATRON_LM:-../shared/megatron-lm-0.19} ;;
  *)      ML=${MEGATRON_LM:-../shared/megatron-lm} ;;
esac
[ -f "$ML/pretrain_gpt.py" ] || { echo "gpu_prep: no Megatron-LM checkout at $ML (set MEGATRON_LM)" >&2; exit 2; }
for d in .whl .megatron-lm; do
  git check-ignore -q "$d/x" || { echo "gpu_prep: $d/ is not git-ignored (.gitignore)" >&2; exit 2; }
done

# 1. wheels for the device's Python 3.12 (x86-64). One version of each: two stop the install.
#    pydantic's own needs are named too (--no-deps fetches none); typing-extensions rides
#    along because pydantic 2.13 wants >= 4.14.1 and the image's version was never read.
WHEELS=(megatron-core==$MCORE pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2 typing-extensions==4.15.0)
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "${WHEELS[@]}"
n=$(ls .whl/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "gpu_prep: expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; }

# 2. Megatron-LM's training code, without megatron/core (the wheel brings it), tools/ and
#    caches. Whole packages rather than the 52 modules a CPU import reaches: pretrain()
#    imports more inside functions on the way (fused_kernels, datasets, ...).
rm -rf .megatron-lm && mkdir -p .megatron-lm/megatron
cp "$ML"/pretrain_gpt.py "$ML"/gpt_builders.py "$ML"/model_provider.py .megatron-lm/
cp "$ML"/LICENSE "$ML"/SOURCE.md .megatron-lm/ 2>/dev/null || true
for p in "$ML"/megatron/*/; do
  [ "$(basename "$p")" = core ] || cp -r "$p" .megatron-lm/megatron/
done
[ -f "$ML/megatron/__init__.py" ] && cp "$ML/megatron/__init__.py" .megatron-lm/megatron/
find .megatron-lm -name __pycache__ -prune -exec rm -rf {} +
rm -rf .megatron-lm/megatron/legacy/fused_kernels/build

# 3. what travels: the checkout (tracked + untracked-not-ignored) and the two carried folders
tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
whl=$(du -sb .whl | cut -f1); mlb=$(du -sb .megatron-lm | cut -f1)
total=$((tree + whl + mlb))
awk -v a="$tree" -v b="$whl" -v c="$mlb" -v t="$total" 'BEGIN { m = 1048576; printf \
  "gpu_prep: checkout %.1f MiB + .whl %.1f MiB + .megatron-lm %.1f MiB = %.1f MiB (limit 64)\n", \
  a / m, b / m, c / m, t / m }'
[ "$total" -lt $((60 * 1048576)) ] || { echo "gpu_prep: over 60 MiB: too much would travel" >&2; exit 1; }
ls .whl
cat <<EOF

device run (the run tool):  carry: [".whl", ".megatron-lm"]   timeout_s: 600
  command: bash scripts/gpu_check.sh
  (a rerun of some steps: bash scripts/gpu_check.sh --budget 240 --only setup,lanes,fp32/base,fp32/dhelix,fp32/compare)
results: \$OUT/summary.json (+ the DHelix trace, and logs of a hang or failures); see
  bash scripts/gpu_check.sh --plan
EOF
