#!/usr/bin/env bash
# Run the test suite in .venv. Exits non-zero on any failure, and also when no
# test was collected (pytest's exit code 5), which would otherwise hide a
# broken collection as "nothing to do".
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
