#!/usr/bin/env bash
# The whole GPU check in one command, in under 10 minutes on one GPU (bench/gpu_check.py):
# tokens/s and MFU of the Llama recipe, eager and compiled, one process and torchrun
# DDP/FSDP2 over nccl; FSDP2 peak memory per rank; installs bit-exact on the device; two
# learners of a run on this host on GPUs of their own.  Writes bench/results/gpu.json and
# exits non-zero when a check fails.
#
#   bench/gpu_check.sh                          # on a GPU machine, from anywhere
#   bench/gpu_check.sh --device cpu --quick     # the same steps at tiny sizes on a CPU
#   PYTHON=.venv/bin/python bench/gpu_check.sh  # another interpreter than `python`
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m bench.gpu_check "$@"
