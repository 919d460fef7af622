#!/usr/bin/env bash
# Run the test suite in .venv. Exits non-zero on any failure, and also when no
# test was collected (pytest's exit code 5), which would otherwise hide a
# broken collection as "nothing to do".
#
# Two pytest workers (pytest-xdist) by default: much of a test's time is a process starting (imports, Ray,
# an engine) on one core, so two at a time keep both cores busy. A file's tests stay on one worker, and so do
# the files sharing a costly session fixture (tests/conftest.py). VLMRL_TEST_WORKERS=0 runs them in this process,
# one after another. The slowest tests are listed at the end, to see where the suite's time goes.
set -uo pipefail
cd "$(dirname "$0")/.."
# The tiny model and the quickstart's tuned one, which most tests use: built (once per clone) before pytest
# starts, so that no test's timeout runs while a worker waits for the other to build them.
if ! assets_log=$(.venv/bin/python -m vlmrl.testing.assets --quickstart 2>&1); then
    echo "$assets_log" >&2
    echo "test.sh: building the tiny test assets failed" >&2
    exit 1
fi
.venv/bin/python -m pytest -q -n "${VLMRL_TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
