#!/usr/bin/env bash
# Every figure of bench/RESULTS.md, appended to bench/results.jsonl.
# Usage: FASTJOBS_DSN=postgresql://... bench/run_all.sh   (default: the embedded server)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results.jsonl
run() { echo "+ $*"; "$@" --results "$out"; }

run fastjobs bench --enqueue-only
run fastjobs bench --drain-only --processes 2
FASTJOBS_IMPL=python run fastjobs bench --drain-only --processes 2
run fastjobs bench --drain-only --processes 2 --compare-sync
run fastjobs bench --drain-only --processes 2 --keep-completed
run fastjobs bench --drain-only --processes 1
run fastjobs bench --drain-only --processes 4
run fastjobs bench --latency-only --rate 1000 --latency-seconds 10
run fastjobs bench --producers 16 --repeat 3
run fastjobs bench --producers 1 --repeat 5
run fastjobs bench --cleaner 1000000
run fastjobs bench --soak 10 --hold 120 --plot bench/soak.png
