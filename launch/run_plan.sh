# Sourced by train_local.sh and train_slurm.sbatch, which set `here` (this directory), `script`
# (the file whose top comment block is the usage text) and `mode` (plan.py's local or slurm).
# Parses their [-h|--help] [--dry-run] CONFIG [KEY=VALUE ...], then prints or runs the plan.
dry_run=0
args=()
plan_flags=()
usage() {  # the comment block at the top of the launching script
  awk 'NR > 1 && /^#/ && !/^#SBATCH/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$script"
}
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;  # before anything runs: --help never launches
    --dry-run) dry_run=1 ;;
    --skip-local-checks) plan_flags+=(--skip-local-checks) ;;  # validate for the nodes, not this machine
    *) args+=("$arg") ;;
  esac
done
if [[ ${#args[@]} -eq 0 ]]; then
  usage >&2
  exit 2
fi
python="${PYTHON:-python}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "$(basename "$script"): no '$python' on PATH: activate the project's environment" \
       "(source .venv/bin/activate) or set PYTHON=/path/to/python" >&2
  exit 2
fi
plan="$("$python" "$here/plan.py" "$mode" ${plan_flags[@]+"${plan_flags[@]}"} "${args[@]}")" || exit $?
if (( dry_run )); then
  printf '%s\n' "$plan"
  exit 0
fi
exec bash -c "$plan"
