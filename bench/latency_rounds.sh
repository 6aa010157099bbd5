#!/usr/bin/env bash
# Builds side by side at 1,000 jobs/s (issue 22 §5): bench/latency_call.py for each build in turn,
# the order rotated each round, one JSON line a run appended to OUT; each build on a database of
# its own (fj_lat_NAME, NAME up to a '+'), migrated by that build.
#
#   bench/latency_rounds.sh ROUNDS OUT NAME=TREE[:CONFIG] ...
#
# TREE: a checkout built in place (`python setup.py build_ext --inplace`); CONFIG: WorkerConfig
# fields as JSON, e.g. 'new+norot=.:{"rotate": false}'. Summary: bench/latency_summary.py OUT.
set -euo pipefail
rounds=$1 out=$2
shift 2
builds=("$@")
here=$(cd "$(dirname "$0")" && pwd)
n=${#builds[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        spec=${builds[$(((k + r) % n))]}
        name=${spec%%=*} rest=${spec#*=}
        tree=${rest%%:*} config='{}'
        [[ $rest == *:* ]] && config=${rest#*:}
        PYTHONPATH=$tree python "$here/latency_call.py" --db "fj_lat_${name%%+*}" --seconds 10 \
            --label "$name" --config "$config" >>"$out"
    done
done
