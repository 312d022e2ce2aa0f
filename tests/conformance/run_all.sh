#!/usr/bin/env bash
# The whole CPU selection of PyTorch's distributed_test, for flagos_shm and for gloo, at world
# sizes 2 and 3, on this torch and, when its venv exists, on torch 2.10 (one c10d adapter on
# both); then the table (table.py).
#
#   bash tests/conformance/run_all.sh [OUT_DIR]     (default /tmp/flagos_conformance)
#
# Environment: PYTHON (default python), TORCH210_PYTHON (default the .ci/compat venv; set
# it empty to skip), CONF_TIMEOUT (seconds per test, default 90), CONF_WORLD_SIZES (default
# "2 3"), CONF_BACKENDS (default "flagos_shm gloo"), CONF_TABLE (the markdown file the table
# replaces its section in; default docs/conformance.md). Each configuration runs in its own
# process (the suite reads its configuration at import) under an overall limit; results are
# one JSON line per test (run.py), so a configuration cut short keeps what it ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/flagos_conformance}
mkdir -p "$out"
py=${PYTHON:-python}
py210=${TORCH210_PYTHON-/root/.cache/flagos_shm/venv-torch2.10/bin/python}
timeout_s=${CONF_TIMEOUT:-90}
sizes=${CONF_WORLD_SIZES:-2 3}
backends=${CONF_BACKENDS:-flagos_shm gloo}

run_one() {  # python tag route(label) backend world_size
    local python=$1 tag=$2 route=$3 backend=$4 ws=$5
    local name="$out/$tag-$route-$backend-ws$ws"
    rm -f "$name.jsonl"
    echo "== $(date -u +%H:%M:%S) $name"
    timeout -k 30 7200 "$python" tests/conformance/run.py --backend "$backend" \
        --world-size "$ws" --timeout "$timeout_s" --out "$name.jsonl" > "$name.log" 2>&1
    echo "   rc=$? $(grep -c '"pass"' "$name.jsonl") pass, $(grep -c '"fail"' "$name.jsonl") fail," \
         "$(grep -c '"skip"' "$name.jsonl") skip"
}

tag=torch$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
for ws in $sizes; do
    for backend in $backends; do
        run_one "$py" "$tag" adapter "$backend" "$ws"
    done
done
if [ -n "$py210" ] && [ -x "$py210" ]; then
    # The suite needs expecttest; keep it out of the shared venv (a private target dir).
    # flagos_shm comes from this checkout (its extension is abi3; the c10d adapter is built
    # for torch 2.10 on first use) unless the venv has it installed.
    lib="$out/pylib-torch2.10"
    "$py210" -c "import expecttest" 2>/dev/null || [ -d "$lib/expecttest" ] \
        || "$py210" -m pip install -q --target "$lib" expecttest
    "$py210" -c "import flagos_shm" 2>/dev/null || lib="$PWD/python:$lib"
    export PYTHONPATH="$lib${PYTHONPATH:+:$PYTHONPATH}"
    for ws in $sizes; do
        for backend in $backends; do
            run_one "$py210" torch2.10 adapter "$backend" "$ws"
        done
    done
fi
"$py" tests/conformance/table.py "$out" --write "${CONF_TABLE:-docs/conformance.md}"
