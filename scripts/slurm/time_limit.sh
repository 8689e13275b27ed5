# Sourced by the sbatch files (which set DHELIX_SBATCH to their name): a job step that
# ends well at the time limit.
# Slurm sends USR1 to the batch shell before the time limit (#SBATCH --signal=B:USR1@S);
# `run_step` passes it on to the ranks (the tasks of the job's steps) as SIGTERM when the command asks for
# --exit-signal-handler (the ranks then finish the step, save and exit 0), and
# `resubmit ARGS...` submits this job's script again with ARGS (same nodes, tasks, time
# limit and partition, after this job ends), at most DHELIX_RESUBMITS times (default 3;
# each job passes one less).

# run_step CMD...: run CMD (an srun line) in the background; rc = its exit code,
# stopping = 1 if the time-limit signal came
run_step() {
  stopping=0
  local graceful=0 a
  for a in "$@"; do [ "$a" = "--exit-signal-handler" ] && graceful=1; done
  on_time_limit() {
    stopping=1
    echo "$DHELIX_SBATCH: time limit near (USR1): SIGTERM to the ranks (--exit-signal-handler)"
    # to the tasks of this job's steps (SIGTERM to srun itself would cancel the step)
    local step
    for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i | grep -v -e batch -e extern); do
      scancel --signal=TERM "$step" || true
    done
  }
  [ "$graceful" = 1 ] && trap on_time_limit USR1
  set +e
  "$@" &
  step_pid=$!
  while :; do                 # a trapped signal interrupts `wait`; the step goes on
    wait "$step_pid"; rc=$?
    kill -0 "$step_pid" 2>/dev/null || break
  done
  set -e
}

# resubmit ARGS...: this job's script again with ARGS
resubmit() {
  local left=${DHELIX_RESUBMITS:-3} job script out limit new
  if [ "$left" -le 0 ]; then
    echo "$DHELIX_SBATCH: stopped before the time limit; not resubmitted (DHELIX_RESUBMITS=0)"
    return 0
  fi
  job=$(scontrol show job -o "$SLURM_JOB_ID")
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $job"; }
  script=$(field Command); out=$(field StdOut); limit=$(field TimeLimit)
  local flags=(--parsable --dependency="afterany:$SLURM_JOB_ID" --nodes="$SLURM_JOB_NUM_NODES"
               --ntasks="$SLURM_NTASKS" --output="$(dirname "$out")/$SLURM_JOB_NAME-%j.out")
  [ -n "$limit" ] && [ "$limit" != UNLIMITED ] && flags+=(--time="$limit")
  [ -n "${SLURM_JOB_PARTITION:-}" ] && flags+=(--partition="$SLURM_JOB_PARTITION")
  new=$(DHELIX_RESUBMITS=$((left - 1)) sbatch "${flags[@]}" "$script" "$@")
  echo "$DHELIX_SBATCH: resubmitted as job ${new%%;*} ($((left - 1)) more allowed)"
}
