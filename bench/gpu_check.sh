#!/usr/bin/env bash
# The GPU check lives with the studies (studies/gpu_check.sh, docs/PERF.md "GPU check");
# this name is kept because the project's runbook says `bash bench/gpu_check.sh OUTDIR`.
exec bash "$(dirname "$0")/../studies/gpu_check.sh" "$@"
