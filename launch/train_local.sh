#!/usr/bin/env bash
# Launch an experiment on this machine: torchrun starts the training ranks; on GPUs a Ray head
# that sees only the GPUs training leaves hosts the rollout fleet (on CPU, rank 0 starts a
# private Ray instance itself).
#
#   launch/train_local.sh [--dry-run] CONFIG [KEY=VALUE ...]
#
# -h/--help prints this text. --dry-run prints exactly the commands a launch runs (computed by
# launch/plan.py) and exits; --skip-local-checks validates for the nodes, not this machine (a GPU
# recipe dry-run from a CPU login node). Runs in the directory it was started from.
# PYTHON selects the interpreter (default: python on PATH); its environment's torchrun and ray are used.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
script="${BASH_SOURCE[0]}"
mode=local
source "$here/run_plan.sh"
