#!/usr/bin/env bash
# The GPU runs behind bench/results/: pyep's suite, DeepEP V1's own tests (on pyep and on DeepEP), and the
# bench with DeepEP and NCCL beside pyep, on a host with one or more GPUs. Run from the repository root.
#
# Usage: bench/device/run.sh STAGE [STAGE...]
#   setup            pip install . (pyep); start building DeepEP V1 from $DEEPEP_SRC in /tmp/deepep (background)
#   suite:N[:mps]    PYEP_TEST_DEVICE=cuda torchrun --nproc-per-node N -m pytest tests (ranks share GPUs when N
#                    exceeds them; ":mps" starts the CUDA MPS daemon for the stage; SUITE_TESTS picks tests;
#                    each rank's output is kept apart in suite-N-ranks/)
#   deepep-tests:N   DeepEP's tests/test_intranode.py and test_low_latency.py (DEEPEP_TESTS picks), unmodified,
#                    --num-processes N: on pyep (bench/deepep/run_deepep_test.sh), then on DeepEP itself
#   bench:N          python -m pyep.bench --quick with N ranks: pyep, NCCL's baseline, and DeepEP when it built
#   ll-bench:N[:K]   python -m pyep.bench --quick --ll with N ranks (pyep and DeepEP); with K, also pyep's rows on
#                    emulated nodes of K ranks (--ll-nodes K)
#   nodes:N:K        low-latency mode across nodes emulated with PYEP_RANKS_PER_NODE=K (NVSHMEM, no NIC: remote
#                    transport none, bootstrap over lo): the low-latency test files with N ranks, every buffer made
#                    with PYEP_RANKS_PER_NODE=K (nodes-N-ranks/), then python -m pyep.bench --quick --ll --impls pyep
#                    --ll-nodes K
#   ncu-ll:N         Nsight Compute over pyep's hooked low-latency kernels (bench/device/ll_profile.py, each
#                    kernel alone), compiled with -lineinfo: $RES/ncu-ll.ncu-rep and a summary
#   ab:N[:R]         A/B of builds or settings on one host: python -m pyep.bench, pyep only, at the reference
#                    normal case (4096 tokens, hidden 7168, top-8 of 256, 24 SMs, 30 iterations), once per variant
#                    and round, the variants alternating, R rounds (default 2); AB_VARIANTS names them,
#                    "name[=VAR=value,...];...", e.g. "old=PYEP_NORMAL_THREADS=768,PYEP_COPY_UNROLL=8;new"; AB_OPS
#                    the ops (pyep.bench --ops, default the four normal ones); then a table of the median µs of
#                    each op, a column a run (ab-N/)
#   probe:N          bench/device/normal_probe.py with N ranks: the probe build of the normal-mode kernels, each
#                    warp's role, rows, end and waits in one call of each op, summed up (probe-N.json: the records)
#   timeline:N       the same calls with the kernels' timeline (PYEP_LL_TIMELINE=1, ll_profile.py --timeline):
#                    per kernel and phase, where each block's time goes, rank 0 and the slowest rank
#   hostpath[:N]     bench/hostpath.py on GPU 0, N runs (default 2): each call's host time split into Python, the Go
#                    core and the driver's launch (hostpath-I.log, hostpath-I.json), then the low-latency calls'
#                    (--ll: hostpath-ll-I.log, hostpath-ll-I.json)
#   stamps:CALL      bench/device/call_stamps.py CALL (dispatch, combine or cached) on GPU 0: the call's Python split
#                    at its steps (stamps-CALL.log)
# Environment: DEEPEP_SRC (default .deepep: DeepEP V1's source, git archive 9249c25), RES (logs, default
# /tmp/res), OUT (where res.tgz, all of RES, is written after every stage: the device tool's folder), STAGE_TIMEOUT (seconds a
# stage may take, default 420). Every stage's output goes to $RES/<stage>.log; a failed stage does not stop
# the next; the exit status is the number of failed stages.
set -uo pipefail

RES=${RES:-/tmp/res}
DEEPEP_SRC=${DEEPEP_SRC:-.deepep}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}
mkdir -p "$RES"
export RES DEEPEP_SRC
root=$(pwd)
failed=0

mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
}
mps_off() {
    echo quit | nvidia-cuda-mps-control 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    sleep 1
}

deepep_ready() {  # waits for the background build; true when DeepEP imports
    [ -f /tmp/deepep-build.pid ] && while kill -0 "$(cat /tmp/deepep-build.pid)" 2>/dev/null; do sleep 2; done
    (cd /tmp && PYTHONPATH=/tmp/deepep python3 -c 'import deep_ep, deep_ep_cpp' 2>/dev/null)
}

setup() {
    nvidia-smi topo -m
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    git log -1 --format='pyep at %H %s' 2>/dev/null
    if [ -d "$DEEPEP_SRC" ]; then
        rm -rf /tmp/deepep && cp -r "$DEEPEP_SRC" /tmp/deepep
        (cd /tmp/deepep && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl \
            NVCC_APPEND_FLAGS=-I/usr/local/cuda/include/cccl python3 setup.py build_ext --inplace \
            >"$RES/deepep-build.log" 2>&1) &
        echo $! >/tmp/deepep-build.pid
        echo "building DeepEP from $DEEPEP_SRC in the background ($RES/deepep-build.log)"
    else
        echo "no DeepEP source at $DEEPEP_SRC: DeepEP is not built"
    fi
    python3 -m pip install --no-build-isolation --no-deps -q .
}

suite() {  # N [mps]
    [ "${2:-}" = mps ] && mps_on
    # Each rank's output also goes to its own file (torchrun --log-dir): the ranks' progress lines interleave.
    local dir="$RES/suite-$1${2:+-$2}-ranks" r f
    PYEP_TEST_DEVICE=cuda torchrun --nproc-per-node "$1" --log-dir "$dir" --redirects 3 --tee 3 \
        -m pytest -q -rfE -p no:cacheprovider ${SUITE_TESTS:-tests}
    local rc=$?
    # Each rank's log also as a flat file (a tool that brings files back may not descend into the log directory).
    for ((r = 0; r < $1; r++)); do
        f=$(ls -t "$dir"/*/attempt_0/"$r"/stdout.log 2>/dev/null | head -n 1)
        [ -n "$f" ] && cp "$f" "$RES/suite-$1${2:+-$2}-rank$r.log"
    done
    [ "${2:-}" = mps ] && mps_off
    return $rc
}

deepep_tests() {  # N
    local rc=0 t
    for t in ${DEEPEP_TESTS:-test_intranode.py test_low_latency.py}; do
        timeout 300 bench/deepep/run_deepep_test.sh /tmp/deepep/tests "$RES/pyep-$t-$1.log" "$t" --num-processes "$1" \
            >/dev/null || rc=1
        tail -n 25 "$RES/pyep-$t-$1.log"
    done
    if deepep_ready; then
        for t in ${DEEPEP_TESTS:-test_intranode.py test_low_latency.py}; do
            echo "== DeepEP V1 itself: $t --num-processes $1"
            (cd /tmp/deepep/tests && PYTHONPATH=/tmp/deepep timeout 300 python3 "$t" --num-processes "$1") >"$RES/deepep-$t-$1.log" 2>&1 || rc=1
            tail -n 25 "$RES/deepep-$t-$1.log"
        done
    else
        echo "DeepEP did not build: see deepep-build.log"; tail -n 20 "$RES/deepep-build.log"; rc=1
    fi
    return $rc
}

bench_run() {  # N extra-args...
    local n=$1; shift
    deepep_ready || echo "DeepEP did not build: the bench records why its column is missing"
    PYTHONPATH=/tmp/deepep:${PYTHONPATH:-} python3 -m pyep.bench --quick --nprocs "$n" --out "$RES/bench-$n$(echo "$*" | tr -d ' ')" "$@" | tr -d '\r'
}

nodes() {  # N K
    export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
    local rc=0
    PYEP_RANKS_PER_NODE="$2" PYEP_TEST_DEVICE=cuda torchrun --nproc-per-node "$1" --log-dir "$RES/nodes-$1-ranks" \
        --redirects 3 --tee 3 -m pytest -q -rfEs -p no:cacheprovider tests/test_low_latency.py \
        tests/test_low_latency_graphs.py tests/test_low_latency_nodes.py tests/test_runtime_sequence.py \
        tests/test_peer_death.py || rc=1
    python3 -m pyep.bench --quick --ll --impls pyep --ll-nodes "$2" --nprocs "$1" --out "$RES/bench-$1-nodes-$2" |
        tr -d '\r' || rc=1
    return $rc
}

ncu_ll() {  # N
    PYEP_JIT_FLAGS=-lineinfo PYEP_JIT_CACHE_DIR=/tmp/pyep-lineinfo PYEP_TIMEOUT_S=300 \
        ncu --target-processes all -k regex:'dispatch|combine' --launch-skip 8 --launch-count 8 --set full \
        --import-source yes -f -o "$RES/ncu-ll" torchrun --nproc-per-node "$1" bench/device/ll_profile.py || return
    ncu --import "$RES/ncu-ll.ncu-rep" --page details --csv >"$RES/ncu-ll-details.csv"
    ncu --import "$RES/ncu-ll.ncu-rep" --page details |
        grep -E 'pyep|Duration|Elapsed Cycles|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Grid Size|Block Size|Stall|Warp Cycles Per Issued'
}

ab() {  # N [rounds]
    local n=$1 rounds=${2:-2} r v name vars row
    local -a runs=()
    for r in $(seq 1 "$rounds"); do
        IFS=';' read -ra variants <<<"${AB_VARIANTS:-base}"
        for v in "${variants[@]}"; do
            name=${v%%=*}
            vars=$([ "$v" = "$name" ] || echo "${v#*=}" | tr ',' ' ')
            env $vars timeout 180 python3 -m pyep.bench --nprocs "$n" --tokens 4096 --hidden 7168 --sms 24 --impls pyep \
                --ops "${AB_OPS:-dispatch_bf16,dispatch_fp8,dispatch_cached,combine_bf16}" --no-plots --warmup 10 --iters 30 \
                --host-iters 2 --out "$RES/ab-$n/$name-$r" >"$RES/ab-$n/$name-$r.log" 2>&1 || echo "$name-$r failed"
            runs+=("$name-$r")
        done
    done
    printf '%-16s' op; printf ' %12s' "${runs[@]}"; echo
    for row in dispatch_bf16 dispatch_fp8 dispatch_cached combine_bf16; do
        printf '%-16s' "$row"
        for v in "${runs[@]}"; do
            printf ' %12s' "$(awk -v op="$row" '$1 == "pyep" && $2 == op {print $10}' "$RES/ab-$n/$v/table.txt" 2>/dev/null)"
        done
        echo
    done
}

probe() {  # N
    PYEP_TIMEOUT_S=60 torchrun --nproc-per-node "$1" bench/device/normal_probe.py --json "$RES/probe-$1.json"
}

timeline() {  # N
    PYEP_TIMEOUT_S=60 torchrun --nproc-per-node "$1" bench/device/ll_profile.py --timeline --iters 20
}

hostpath() {  # [N]
    local i rc=0
    for ((i = 1; i <= ${1:-2}; i++)); do
        CUDA_VISIBLE_DEVICES=0 python3 bench/hostpath.py --iters 200 --json "$RES/hostpath-$i.json" \
            >"$RES/hostpath-$i.log" 2>&1 || rc=1
        grep -v -e Warning -e 'return func' "$RES/hostpath-$i.log"
        CUDA_VISIBLE_DEVICES=0 python3 bench/hostpath.py --ll --iters 200 --json "$RES/hostpath-ll-$i.json" \
            >"$RES/hostpath-ll-$i.log" 2>&1 || rc=1
        grep -v -e Warning -e 'return func' "$RES/hostpath-ll-$i.log"
    done
    return $rc
}

stamps() {  # CALL
    # Outside the checkout, so that the installed pyep is the one whose source is stamped.
    (cd /tmp && CUDA_VISIBLE_DEVICES=0 python3 "$root/bench/device/call_stamps.py" "$1")
}

for stage in "$@"; do
    IFS=: read -r name a b <<<"$stage"
    log="$RES/$(echo "$stage" | tr ':' '-').log"
    echo "=== $stage ($(date +%T)) -> $log"
    start=$SECONDS
    case $name in
        setup) setup ;;
        suite) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f suite mps_on mps_off); suite $a ${b:-}" ;;
        deepep-tests) deepep_tests "$a" ;;
        bench) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f bench_run deepep_ready); bench_run $a" ;;
        ll-bench) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f bench_run deepep_ready); bench_run $a --ll ${b:+--ll-nodes $b}" ;;
        nodes) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f nodes); nodes $a $b" ;;
        ncu-ll) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f ncu_ll); ncu_ll $a" ;;
        probe) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f probe); probe $a" ;;
        timeline) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f timeline); timeline $a" ;;
        ab) mkdir -p "$RES/ab-$a" && timeout "$STAGE_TIMEOUT" bash -c "$(declare -f ab); ab $a ${b:-}" ;;
        hostpath) timeout "$STAGE_TIMEOUT" bash -c "$(declare -f hostpath); hostpath ${a:-}" ;;
        stamps) timeout "$STAGE_TIMEOUT" bash -c "root=$root; $(declare -f stamps); stamps $a" ;;
        *) echo "unknown stage $stage"; false ;;
    esac > >(tee "$log") 2>&1
    rc=$?
    echo "=== $stage: exit $rc after $((SECONDS - start)) s" | tee -a "$RES/stages.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    cd "$root"
    # After every stage, so that a run cut short still brings back what it did.
    [ -n "${OUT:-}" ] && tar -czf "$OUT/res.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
done
exit $failed
