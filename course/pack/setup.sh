#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, network on):
# Python, a virtual environment in /autograder/venv with tinyconv (its source is in library/, from
# the repository this zip was built from), pytest, and an OpenCL CPU runtime (PoCL) for lesson 4's
# graders. AUTOGRADER_ROOT moves /autograder, as in run_autograder.
set -euo pipefail
ROOT=${AUTOGRADER_ROOT:-/autograder}
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q python3 python3-venv python3-pip pocl-opencl-icd
python3 -m venv "$ROOT/venv"
"$ROOT/venv/bin/python" -m pip install --quiet --upgrade pip
"$ROOT/venv/bin/python" -m pip install --quiet "$ROOT/source/library" "pytest>=7" "pyopencl[pocl]>=2024.1"
