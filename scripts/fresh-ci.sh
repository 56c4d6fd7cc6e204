#!/usr/bin/env bash
# CI as a fresh machine runs it, as far as this one allows: the local SLURM clusters stopped and their state
# (/etc/slurm/slurm.conf, /var/lib/opskit-slurm*) moved aside, the torch extension cache moved aside, pip's cache
# off, a fresh clone of HEAD (so no venv, no runs/, no data/), and `.ci/run` in it. Everything moved is put back
# afterwards, and the clusters that were running are started again, also when the run fails or is interrupted.
#
#   scripts/fresh-ci.sh [--seed N] [--keep] [-- PYTEST_ARGS...]
#
# --seed N: run the tests in a random order (pytest-random-order: modules shuffled, and tests within each module;
# module-scoped fixtures stay shared), reproducible with the same N. --keep: leave the clone (its path is printed).
# --count: also count the trainer start-ups of the run (scripts/count-trainer-starts.py).
# Ends with pytest's summary line, the wall time of `.ci/run` (install included: CI's budget is 5,400 s), the ten
# slowest tests and the exit code of `.ci/run`. Needs root (it stops SLURM and moves /etc files).
set -euo pipefail

SEED=""
KEEP=0
COUNT=0
while (($#)); do
    case $1 in
    --seed) SEED=${2:?--seed needs a number}; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --count) COUNT=1; shift ;;
    --) shift; break ;;
    *) echo "usage: $0 [--seed N] [--keep] [--count] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
    esac
done
[[ -z $SEED || $SEED =~ ^[0-9]+$ ]] || { echo "fresh-ci: --seed: expected a whole number, got '$SEED'" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "fresh-ci: needs root (it stops the local SLURM and moves /etc/slurm/slurm.conf)" >&2; exit 2; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/fresh-ci.XXXXXX)
ASIDE="$WORK/aside"
mkdir -p "$ASIDE"
MOVED=()        # "original<TAB>aside" pairs, restored in reverse order
FREED=()        # paths that were moved aside or absent: what the run leaves there is the run's, removed afterwards
RESTART=()      # local-slurm.sh arguments of the clusters that were running

move_aside() {  # path: moved into $ASIDE when it exists (a symlink is moved as the link)
    local path=$1 target
    if [[ -e $path || -L $path ]]; then
        target="$ASIDE/$(echo "$path" | tr / _)"
        mv "$path" "$target"
        MOVED+=("$path"$'\t'"$target")
    fi
    FREED+=("$path")
}

# shellcheck disable=SC2317  # called by the EXIT trap
restore() {
    local i pair
    set +e
    # an interrupted run: its .ci/run (make, pytest, the trainers) goes first, before its clone and state do
    [[ -n ${CI_PID:-} ]] && kill -- -"$CI_PID" 2>/dev/null && sleep 2
    # the clone's own clusters (the tests start them from the clone's scripts) go before the state is put back
    for args in "" "--nodes 3"; do
        # shellcheck disable=SC2086
        [[ -x "$WORK/clone/scripts/local-slurm.sh" ]] && "$WORK/clone/scripts/local-slurm.sh" stop $args >/dev/null 2>&1
    done
    for path in "${FREED[@]}"; do
        rm -rf "$path"
    done
    for ((i = ${#MOVED[@]} - 1; i >= 0; i--)); do
        pair=${MOVED[i]}
        mv "${pair#*$'\t'}" "${pair%%$'\t'*}"
    done
    for args in "${RESTART[@]}"; do
        # shellcheck disable=SC2086
        "$REPO/scripts/local-slurm.sh" start $args >/dev/null 2>&1 || echo "fresh-ci: could not restart local SLURM ($args)" >&2
    done
    if ((KEEP)); then echo "fresh-ci: clone kept in $WORK/clone"; else rm -rf "$WORK"; fi
}
trap restore EXIT
trap 'exit 130' INT TERM

# Stop what runs, remembering it, then move its state aside.
if "$REPO/scripts/local-slurm.sh" status >/dev/null 2>&1; then
    RESTART+=("")
    "$REPO/scripts/local-slurm.sh" stop >/dev/null
fi
if [[ -e /var/lib/opskit-slurm-multinode/nodes ]] && "$REPO/scripts/local-slurm.sh" status --nodes 3 >/dev/null 2>&1; then
    RESTART+=("--nodes $(cat /var/lib/opskit-slurm-multinode/nodes)")
    "$REPO/scripts/local-slurm.sh" stop --nodes 3 >/dev/null
fi
for path in /etc/slurm/slurm.conf /var/lib/opskit-slurm /var/lib/opskit-slurm-multinode \
    "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" "$HOME/.cache/huggingface"; do
    move_aside "$path"
done

git clone -q "$REPO" "$WORK/clone"
cd "$WORK/clone"
echo "fresh-ci: $(git log -1 --format='%h %s' | cut -c1-100)"
echo "fresh-ci: clone in $WORK/clone${SEED:+, random order seed $SEED}"
export PIP_NO_CACHE_DIR=1
# A temporary folder of its own: pytest keeps only the newest three under /tmp/pytest-of-$USER, so any other pytest
# run on this machine meanwhile would delete this one's (its session fixtures' data) mid-run.
ADDOPTS="${PYTEST_ADDOPTS:-} --basetemp=$WORK/pytest${SEED:+ --random-order-seed=$SEED}${*:+ $*}"
COUNTER=()
((COUNT)) && COUNTER=(python3 "$REPO/scripts/count-trainer-starts.py" --list "$WORK/starts.txt" --by-test "$WORK/starts-by-test.txt" --)
set +e
started=$SECONDS
# in a session of its own (its process group id is CI_PID), so that an interruption ends all of it
setsid env PYTEST_ADDOPTS="$ADDOPTS" CI=true "${COUNTER[@]}" bash .ci/run > >(tee "$WORK/ci.log") 2>&1 &
CI_PID=$!
wait "$CI_PID"
status=$?
CI_PID=""
set -e
cp "$WORK/ci.log" "/tmp/fresh-ci-last.log"
echo "fresh-ci: .ci/run took $((SECONDS - started)) s, install included (CI's limit: 5400 s)"
echo "fresh-ci: the ten slowest tests:"
# pytest's --durations table: "12.34s call     tests/test_x.py::test_y"
grep -E '^[0-9.]+s (setup|call|teardown) ' "$WORK/ci.log" | sort -rn | head -10 | sed 's/^/    /' || true
if ((COUNT)); then
  echo "fresh-ci: the ten tests with the most trainer start-ups:"
  head -10 "$WORK/starts-by-test.txt" | sed 's/^/    /' || true
fi
echo "fresh-ci: .ci/run exit $status (log: /tmp/fresh-ci-last.log)"
exit "$status"
