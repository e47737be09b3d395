# The step runner of a prepared GPU run, sourced by benchmarks/gpu_check.sh and
# benchmarks/gpu_study.sh. GPU time is scarce: steps run in the order of PLAN,
# each under min(its cap, the budget left); summary.txt is rewritten before and after every step
# and steps.log gets every step's output as it comes, so a run killed at any point still returns
# everything before it (docs/gpu.md, "The GPU check"; docs/gpu_study.md).
#
# The caller sets PLAN (entries "name|cap in seconds|basis of the estimate"), BUDGET_S, TITLE (the
# summary's first words), OUT, and may define key_results (lines appended to summary.txt at the end).
# step exports STEP_LIMIT_S, the step's own limit, for a command that sizes itself to it.

field() { local IFS='|'; read -r -a parts <<<"$1"; echo "${parts[$2]}"; }

cap_of() {
    local entry
    for entry in "${PLAN[@]}"; do
        if [ "$(field "$entry" 0)" = "$1" ]; then field "$entry" 1; return; fi
    done
    echo "gpu_steps.sh: no step named $1 in PLAN" >&2
    exit 3
}

print_plan() {
    local entry cap total=0 index=0
    echo "$TITLE plan: steps in order of value, each under its own cap (seconds)"
    for entry in "${PLAN[@]}"; do
        index=$((index + 1))
        cap=$(field "$entry" 1)
        total=$((total + cap))
        printf '%2d. %-13s %4d s   %s\n' "$index" "$(field "$entry" 0)" "$cap" "$(field "$entry" 2)"
    done
    printf 'total %d s (budget %d s)\n' "$total" "$BUDGET_S"
}

declare -a SUMMARY=()
FAILED=0
NOT_RUN=0
STARTED=$SECONDS

write_summary() {  # write_summary [LINE FOR THE STEP IN PROGRESS]
    {
        echo "$TITLE, $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - STARTED)) s of ${BUDGET_S} s; output in $OUT"
        printf '%s\n' "${SUMMARY[@]}"
        if [ $# -gt 0 ]; then echo "$1"; fi
    } >"$OUT/summary.txt"
}

step() {  # step NAME CMD...: run CMD under min(cap, budget left), log it, record the outcome
    local name=$1
    shift
    local cap left limit start rc took shown
    cap=$(cap_of "$name")
    left=$((BUDGET_S - (SECONDS - STARTED)))
    if [ "$left" -lt 10 ]; then
        SUMMARY+=("NOT RUN  $name (time budget spent)")
        NOT_RUN=1
        write_summary
        return 2
    fi
    limit=$((cap < left ? cap : left))
    export STEP_LIMIT_S=$limit
    write_summary "RUNNING  $name (limit ${limit} s, started $((SECONDS - STARTED)) s into the run)"
    shown="$*"
    shown=${shown//$'\n'/ }
    echo "=== $name (limit ${limit} s, $((SECONDS - STARTED)) s into the run): ${shown:0:160}" | tee -a "$OUT/steps.log"
    start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$OUT/steps.log"
    rc=${PIPESTATUS[0]}
    took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS     $name (${took} s of ${cap} s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("FAIL     $name (stopped at its limit, ${took} s)")
        FAILED=1
    else
        SUMMARY+=("FAIL     $name (rc=$rc, ${took} s of ${cap} s)")
        FAILED=1
    fi
    write_summary
    return "$rc"
}

finish() {  # record the steps not run, write the summary with the key results, exit 0 / 1 (a step failed) / 2 (not run)
    local entry name recorded line
    for entry in "${PLAN[@]}"; do
        name=$(field "$entry" 0)
        recorded=0
        for line in "${SUMMARY[@]}"; do
            case "$line" in *" $name ("*) recorded=1 ;; esac
        done
        if [ "$recorded" -eq 0 ]; then
            SUMMARY+=("NOT RUN  $name (an earlier step failed)")
            NOT_RUN=1
        fi
    done
    write_summary
    {
        if declare -F key_results >/dev/null; then key_results; fi
        if [ "$FAILED" -ne 0 ]; then echo "${TITLE^^} FAILED"
        elif [ "$NOT_RUN" -ne 0 ]; then echo "${TITLE^^} INCOMPLETE"
        else echo "${TITLE^^} PASSED"; fi
    } >>"$OUT/summary.txt"
    echo
    cat "$OUT/summary.txt"
    [ "$FAILED" -ne 0 ] && exit 1
    [ "$NOT_RUN" -ne 0 ] && exit 2
    exit 0
}

# install_wheels: deepspeed and its pydantic/hjson are not in the GPU image; the wheels copied in
# (benchmarks/gpu_wheels.sh, .whl/) are. Nothing to do where deepspeed imports.
install_wheels() {
    if "$PY" -c "import deepspeed" >/dev/null 2>&1; then
        echo "deepspeed already importable: nothing to install"
        return 0
    fi
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "deepspeed is missing and no wheels in .whl/: run benchmarks/gpu_wheels.sh where pip reaches an index and copy .whl/ here" >&2
        return 1
    fi
    echo "installing $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/acco_site \
        .whl/*.whl
}
