#!/usr/bin/env bash
# Run the test suite in .venv. Exits non-zero on any failure, and also when no
# test was collected (pytest's exit code 5), which would otherwise hide a
# broken collection as "nothing to do".
#
# One process by default. VLMRL_TEST_WORKERS=N runs N pytest-xdist workers: a file's tests stay on one worker,
# and so do the files sharing a costly session fixture (tests/conftest.py). On a 2-core machine two workers were
# not faster (the runs are CPU-bound; docs/performance.md), and tests that start Ray in-process may join another
# worker's cluster. The slowest tests are listed at the end, to see where the suite's time goes.
set -uo pipefail
cd "$(dirname "$0")/.."
# The tiny model and the quickstart's tuned one, which most tests use: built (once per clone) before pytest
# starts, so that no test's timeout runs while a worker waits for the other to build them.
if ! assets_log=$(.venv/bin/python -m vlmrl.testing.assets --quickstart 2>&1); then
    echo "$assets_log" >&2
    echo "test.sh: building the tiny test assets failed" >&2
    exit 1
fi
# The project's own modules compiled to bytecode once (a few seconds): where PYTHONDONTWRITEBYTECODE is set, as on
# CI's machine, every process of every run the suite starts would otherwise compile each module it imports again.
.venv/bin/python -m compileall -q -j 0 vlmrl tests benchmarks > /dev/null || true
# The other tiny assets (a few minutes of tuning, mostly one thread) built in the background while the first tests
# run, which leave about a third of the 2 cores idle (docs/performance.md): a test that needs one before it is ready
# waits on its lock (vlmrl/testing/assets.py), as it would wait for its own build. Only for a whole-suite run: a
# chosen few tests build what they use.
prebuild_pid=""
prebuild_log=""
if [ $# -eq 0 ]; then
    prebuild_log=$(mktemp -t vlmrl-prebuild.XXXXXX)
    # Passive OpenMP waits: a tuning thread waiting for its sibling sleeps instead of spinning on a core a test
    # could use (the same threads and the same numbers).
    OMP_WAIT_POLICY=PASSIVE nice -n 10 .venv/bin/python -m vlmrl.testing.assets \
        --build agent text judge distill families qwen3_5 > "$prebuild_log" 2>&1 &
    prebuild_pid=$!
    trap 'kill "$prebuild_pid" 2>/dev/null; rm -f "$prebuild_log"; exit 130' INT TERM
fi
workers=()
if [ "${VLMRL_TEST_WORKERS:-0}" != 0 ]; then
    workers=(-n "$VLMRL_TEST_WORKERS" --dist loadgroup)
fi
.venv/bin/python -m pytest -q "${workers[@]}" --durations=30 "$@"
rc=$?
if [ -n "$prebuild_pid" ] && ! wait "$prebuild_pid"; then
    # The tests that needed an asset built it themselves (and failed there if it cannot be built): shown, not fatal.
    echo "test.sh: building the other tiny assets in the background failed; last lines of its log:" >&2
    tail -n 20 "$prebuild_log" >&2
fi
[ -z "$prebuild_log" ] || rm -f "$prebuild_log"
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
