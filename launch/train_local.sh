#!/usr/bin/env bash
# Launch an experiment on this machine: torchrun starts the training ranks; on GPUs a Ray head
# that sees only the GPUs training leaves hosts the rollout fleet (on CPU, rank 0 starts a
# private Ray instance itself).
#
#   launch/train_local.sh [--dry-run] CONFIG [KEY=VALUE ...]
#
# -h/--help prints this text. --dry-run prints exactly the commands a launch runs (computed by
# launch/plan.py) and exits.
# PYTHON selects the interpreter (default: python on PATH); its environment's torchrun and ray are used.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry_run=0
args=()
usage() {  # the comment block at the top of this file
  awk 'NR > 1 && /^#/ && !/^#SBATCH/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;  # before anything runs: --help never launches
    --dry-run) dry_run=1 ;;
    *) args+=("$arg") ;;
  esac
done
if [[ ${#args[@]} -eq 0 ]]; then
  usage >&2
  exit 2
fi
python="${PYTHON:-python}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "train_local.sh: no '$python' on PATH: activate the project's environment (source .venv/bin/activate)" \
       "or set PYTHON=/path/to/python" >&2
  exit 2
fi
plan="$("$python" "$here/plan.py" local "${args[@]}")" || exit $?
if (( dry_run )); then
  printf '%s\n' "$plan"
  exit 0
fi
exec bash -c "$plan"
