# Sourced by scripts/gpu_check.sh and scripts/cpu_check.sh (not run on its own). They set CHECK
# (gpu_check, cpu_check: the logs' prefix) and WANTED (" tests embed ": the parts to run; every
# part when empty). `run_part NAME SECONDS COMMAND...` runs COMMAND under `timeout`, its output
# shown and kept in /tmp/${CHECK}_NAME.log, and adds "| NAME | exit status | seconds |" to PARTS;
# a part not wanted is recorded as not run (the ${CHECK}_PARTS variable chose).
declare -a PARTS=()
run_part() {
    local name="$1" limit="$2"; shift 2
    if [[ -n "${WANTED// }" && "$WANTED" != *" $name "* ]]; then
        PARTS+=("| $name | not run (${CHECK^^}_PARTS) | 0 |")
        return 0
    fi
    local start=$SECONDS status
    echo "== $name (at most ${limit}s): $*"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "/tmp/${CHECK}_${name}.log"
    status=${PIPESTATUS[0]}
    PARTS+=("| $name | $status$([ "$status" = 124 ] && echo ' (time limit)') | $((SECONDS - start)) |")
    return 0
}
