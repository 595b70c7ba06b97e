#!/usr/bin/env bash
# Launch an experiment on this machine: torchrun starts the training ranks; on GPUs a Ray head
# that sees only the GPUs training leaves hosts the rollout fleet (on CPU, rank 0 starts a
# private Ray instance itself).
#
#   launch/train_local.sh [--dry-run] CONFIG [KEY=VALUE ...]
#
# --dry-run prints exactly the commands a launch runs (computed by launch/plan.py) and exits.
# PYTHON selects the interpreter (default: python on PATH); its environment's torchrun and ray are used.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry_run=0
args=()
for arg in "$@"; do
  if [[ $arg == --dry-run ]]; then dry_run=1; else args+=("$arg"); fi
done
if [[ ${#args[@]} -eq 0 ]]; then
  sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
plan="$("${PYTHON:-python}" "$here/plan.py" local "${args[@]}")" || exit $?
if (( dry_run )); then
  printf '%s\n' "$plan"
  exit 0
fi
exec bash -c "$plan"
