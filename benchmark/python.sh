# Sourced by every benchmark/*.sh after it changes to the repository root: `python` is then the interpreter of make
# setup's venv (.venv, or $VENV), so a shell without the venv on PATH runs the commands as they are written; with no
# venv, an interpreter on PATH that has torch is used, and with neither the script stops in one line naming the fix.
# A `python` the caller defined as a shell function (benchmark.checks.tables records the commands with one) is kept.
if declare -F python >/dev/null; then
    :
elif [[ -x "${VENV:-.venv}/bin/python" ]]; then
    python() { "${VENV:-.venv}/bin/python" "$@"; }
elif ! python -c "import torch" >/dev/null 2>&1; then
    echo "error: no ${VENV:-.venv}/bin/python here and no python with torch on PATH: run 'make setup' first" >&2
    exit 1
fi
