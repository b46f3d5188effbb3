#!/usr/bin/env bash
# DeepEP V2 (DeepEP's main line, `deep_ep.ElasticBuffer`) on a GPU host of this workplace, for pyep.bench's deepep_v2
# column: NCCL 2.30.7 from carried parts, V2 built from a carried source, V2's own smallest tests, and the bench.
# First run on 2x H200 on 2026-11-27 (bench/results/h200x2-2026-11-27-v2/README.md has the calls and the figures).
#
# Run from the repository root on the device machine:  bash bench/device/deepep_v2.sh STEP [STEP...]
#   part:N      copy the carried .v2prep/chunks/cN/part to /tmp/nccl230.parts/cN (four calls: a call carries 64 MiB
#               at most, and nccl230.tar.xz, the lib and include folders of the nvidia-nccl-cu13 2.30.7 wheel, is
#               200 MB; the parts are 50 MiB each, bench/device/nccl230.sha256 has their sums)
#   unpack      check every part's sha256 and the whole file's, join, unpack into /tmp/nccl230 (nvidia/nccl/...)
#   build       copy .deepep2 (V2's source: git archive of DeepEP's main line, with third-party/fmt's include/) to
#               /tmp/deepep2 (unless it is there already: a cut-short build resumes) and build deep_ep._C in place
#               against NCCL 2.30.7 and the host's NVSHMEM wheel (BUILD_TIMEOUT s, default 480; 107 s on 32 cores)
#   bgbuild     the step build in a process session of its own (setsid), so that it goes on after the call returns
#               on a warm machine; /tmp/v2build.rc holds its exit status when done
#   waitbuild   wait (up to BUILD_TIMEOUT s) for bgbuild to end; its status
#   import      import V2 in a fresh python with the run environment: NCCL loaded once, from /tmp/nccl230
#   barrier:N   V2's smallest test, tests/elastic/test_barrier.py --num-processes N
#   ep:N        V2's tests/elastic/test_ep.py at the bench's reference shape, first mode only (FP8 dispatch)
#   coexist     can DeepEP V1 (/tmp/deepep, built by bench/device/run.sh setup) and V2 load in one process? (No:
#               both register the C++ type EventHandle with pybind11; the columns come from two runs.)
#   bench:N     python -m pyep.bench --quick --nprocs N --impls $BENCH_IMPLS (default pyep,baseline,deepep_v2)
#               in the run environment, into $RES/bench-$BENCH_TAG-N (pyep installed first: run.sh setup)
#   all         part:3, unpack, build, import
# Environment: RES (logs, default /tmp/v2res; tarred to $OUT/v2res.tgz after every step), BUILD_TIMEOUT,
# STEP_TIMEOUT (default 420 s for each test step), FRESH=1 (rebuild from scratch), BENCH_IMPLS, BENCH_TAG.
set -uo pipefail

RES=${RES:-/tmp/v2res}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-480}
STEP_TIMEOUT=${STEP_TIMEOUT:-420}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUMS=$HERE/nccl230.sha256  # the parts' sha256 (c0..c3), then the whole nccl230.tar.xz's
ROOT=$(pwd)
PARTS=/tmp/nccl230.parts
NCCL_TOP=/tmp/nccl230                       # holds nvidia/nccl/{include,lib} and the wheel's dist-info
NCCL_ROOT=$NCCL_TOP/nvidia/nccl
V2=/tmp/deepep2
mkdir -p "$RES" "$PARTS"

# Host rule (KINDS.md): NVLink multicast stays off, in every process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Where V2 finds NCCL, at build and at run: deep_ep/utils/find_pkgs.py:22-24 (EP_NCCL_ROOT_DIR, else NCCL_DIR,
# else the pip wheel's dist-info found on sys.path).
export EP_NCCL_ROOT_DIR=$NCCL_ROOT
# JIT cache (csrc/jit/compiler.hpp:52-54, default $HOME/.deep_ep): in /tmp, kept between calls on a warm machine.
export EP_JIT_CACHE_DIR=/tmp/deep_ep_jit
# One host, no RDMA NIC (NCCL offers no GIN there): csrc/kernels/backend/nccl.cu:86-99 asserts a
# GIN type whenever num_ranks > 1 unless EP_DISABLE_GIN=1.
export EP_DISABLE_GIN=${EP_DISABLE_GIN:-1}

# The run environment of every python that imports V2 (or runs torch.distributed next to it): NCCL 2.30.7 loaded
# before anything else, so that torch's DT_NEEDED libnccl.so.2 (its RPATH points at its own 2.28.9 wheel) resolves
# to the already-loaded 2.30.7 by SONAME; /tmp/nccl230 first on sys.path, so that torch's own preload of
# nvidia/nccl/lib (torch/__init__.py _preload_cuda_deps, where it runs) picks the same file. V2's
# check_nccl_so() (deep_ep/__init__.py:46-68) then sees one libnccl, byte-equal to the one it linked.
run_env() {
    env LD_PRELOAD="$NCCL_ROOT/lib/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}" \
        PYTHONPATH="$NCCL_TOP${PYTHONPATH:+:$PYTHONPATH}" "$@"
}

boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || hostname; }

step_part() {  # N
    local n=$1
    [ -f "$PARTS/boot_id" ] || boot_id >"$PARTS/boot_id"
    if [ "$(cat "$PARTS/boot_id")" != "$(boot_id)" ]; then
        echo "part $n: this is not the machine that got the earlier parts (boot id changed): start again at c0"
        rm -f "$PARTS"/c*; boot_id >"$PARTS/boot_id"
    fi
    cp ".v2prep/chunks/c$n/part" "$PARTS/c$n" || return 1
    ls -l "$PARTS"
    df -h /tmp | tail -n 1
}

step_unpack() {
    if [ -f "$NCCL_ROOT/lib/libnccl.so.2" ] && [ -f "$NCCL_TOP/.ok" ]; then
        echo "already unpacked in $NCCL_TOP"; return 0
    fi
    (cd "$PARTS" && grep ' c[0-3]$' "$SUMS" | sha256sum -c -) || { echo "a part is missing or damaged"; return 1; }
    cat "$PARTS"/c0 "$PARTS"/c1 "$PARTS"/c2 "$PARTS"/c3 >/tmp/nccl230.tar.xz || return 1
    (cd /tmp && grep ' /tmp/nccl230.tar.xz$' "$SUMS" | sha256sum -c -) || return 1
    rm -rf "$NCCL_TOP" && mkdir -p "$NCCL_TOP" && tar -xJf /tmp/nccl230.tar.xz -C "$NCCL_TOP" || return 1
    rm -f /tmp/nccl230.tar.xz "$PARTS"/c[0-3]   # 400 MB back; the unpacked copy is what counts now
    grep -E '#define NCCL_(MAJOR|MINOR|PATCH)' "$NCCL_ROOT/include/nccl.h"
    ls -l "$NCCL_ROOT/lib" "$NCCL_ROOT/include"
    touch "$NCCL_TOP/.ok"
}

step_build() {
    [ -f "$NCCL_TOP/.ok" ] || { echo "NCCL 2.30.7 is not unpacked (step unpack)"; return 1; }
    if [ "${FRESH:-0}" = 1 ] || [ ! -f "$V2/setup.py" ]; then
        [ -d .deepep2 ] || { echo "no .deepep2 here: carry it (bench/README.md, "DeepEP V2")"; return 1; }
        rm -rf "$V2" && cp -r .deepep2 "$V2"
    fi
    [ -f "$V2/third-party/fmt/include/fmt/base.h" ] || { echo "fmt headers missing in $V2/third-party/fmt"; return 1; }
    python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "python", sys.version.split()[0])'
    nvcc --version | tail -n 2
    command -v ninja && ninja --version
    python3 -m pip show nvidia-nvshmem-cu13 nvidia-nccl-cu13 2>/dev/null | grep -E '^(Name|Version|Location)'
    local torch_lib
    torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    readelf -d "$torch_lib/libtorch_cuda.so" | grep -E 'RPATH|RUNPATH|libnccl' || true
    # setup.py:119-124 links -l:libnccl.so.2 with an rpath but no -L: LIBRARY_PATH gives the linker the folder.
    # TORCH_CUDA_ARCH_LIST 9.0 is setup.py's own default (setup.py:142); MAX_JOBS feeds torch's ninja build.
    (cd "$V2" && LIBRARY_PATH="$NCCL_ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" TORCH_CUDA_ARCH_LIST=9.0 \
        MAX_JOBS=${MAX_JOBS:-16} timeout "$BUILD_TIMEOUT" python3 setup.py build_ext --inplace) >"$RES/v2-build.log" 2>&1
    local rc=$?
    grep -E '^ > |error|Error|warning: .*nccl' "$RES/v2-build.log" | head -n 40
    tail -n 15 "$RES/v2-build.log"
    [ $rc -eq 124 ] && echo "build: cut at ${BUILD_TIMEOUT}s; run the step build again on this warm machine (ninja resumes)"
    [ $rc -eq 0 ] || return $rc
    local so
    so=$(ls "$V2"/deep_ep/_C*.so) || return 1
    ls -l "$so"
    readelf -d "$so" | grep -E 'NEEDED|RPATH|RUNPATH'
}

step_import() {
    (cd /tmp && run_env PYTHONPATH="$NCCL_TOP:$V2" python3 - <<'EOF'
import os
import torch
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l})
print("libnccl mapped after import torch:", maps)
print("torch.cuda.nccl.version():", torch.cuda.nccl.version())
import deep_ep
print("deep_ep", deep_ep.__version__, "from", os.path.dirname(deep_ep.__file__))
print("ElasticBuffer:", deep_ep.ElasticBuffer, "topk_idx_t:", deep_ep.topk_idx_t)
print("libnccl mapped after import deep_ep:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l}))
import torch.distributed as dist
pg = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)
print("ProcessGroupNCCL._comm_ptr:", hasattr(pg, "_comm_ptr") if pg else "no ProcessGroupNCCL")
EOF
    )
}

step_barrier() {  # N
    (cd "$V2" && run_env PYTHONPATH="$NCCL_TOP:$V2" EP_BUFFER_DEBUG=1 MASTER_PORT=${MASTER_PORT:-8361} \
        timeout "$STEP_TIMEOUT" python3 tests/elastic/test_barrier.py --num-processes "$1" --num-allocated-qps 8)
}

step_ep() {  # N
    # test_ep.py's first mode (enumerate_ep_modes, test_ep.py:22-31): handle copy, expert alignment 128, FP8
    # dispatch, no bias, no previous event, sync. Ranks hold 4096 - rank tokens (test_ep.py:62).
    (cd "$V2" && run_env PYTHONPATH="$NCCL_TOP:$V2" MASTER_PORT=${MASTER_PORT:-8362} timeout "$STEP_TIMEOUT" \
        python3 tests/elastic/test_ep.py --num-processes "$1" --num-tokens 4096 --hidden 7168 --num-topk 8 \
        --num-experts 256 --num-sms 24 --test-first-only)
}

step_coexist() {
    [ -d /tmp/deepep ] || { echo "no /tmp/deepep (DeepEP V1 built by bench/device/run.sh setup): nothing to try"; return 0; }
    (cd /tmp && run_env PYTHONPATH="$NCCL_TOP:/tmp/deepep" python3 - <<'EOF'
import sys, traceback
import torch
import deep_ep_cpp  # DeepEP V1's extension (registers deep_ep::EventHandle with pybind11)
print("V1 deep_ep_cpp loaded:", deep_ep_cpp.__file__)
sys.path.insert(0, "/tmp/deepep2")
for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep.")]:
    del sys.modules[k]
try:
    import deep_ep  # V2
    print("V2 deep_ep loaded beside V1:", deep_ep.__file__, deep_ep.ElasticBuffer)
except Exception:
    traceback.print_exc()
    print("V2 cannot load beside V1 in one process: run the deepep and deepep_v2 columns in separate bench runs")
EOF
    )
}

step_bench() {  # N
    python3 -c 'import pyep.bench.deepep_v2_runner' 2>/dev/null ||
        { echo "the installed pyep has no deepep_v2_runner: pip install . (with .device/env.sh) first"; return 1; }
    run_env PYEP_BENCH_DEEPEP_V2="$V2" timeout "$STEP_TIMEOUT" python3 -m pyep.bench --quick --nprocs "$1" \
        --impls "${BENCH_IMPLS:-pyep,baseline,deepep_v2}" --out "$RES/bench-${BENCH_TAG:-v2}-$1" | tr -d '\r'
}

step_bgbuild() {
    rm -f /tmp/v2build.rc
    # The copy now, while the carried .deepep2 is surely here (step build copies only when $V2 has no setup.py).
    if [ "${FRESH:-0}" = 1 ] || [ ! -f "$V2/setup.py" ]; then
        [ -d .deepep2 ] || { echo "no .deepep2 here: carry it (bench/README.md, "DeepEP V2")"; return 1; }
        rm -rf "$V2" && cp -r .deepep2 "$V2" || return 1
    fi
    setsid nohup env OUT= RES="$RES" BUILD_TIMEOUT="$BUILD_TIMEOUT" bash -c \
        "bash '$HERE/deepep_v2.sh' build; echo \$? >/tmp/v2build.rc" >"$RES/bgbuild.out" 2>&1 </dev/null &
    echo "V2 build started in the background (pid $!): $RES/bgbuild.out, then /tmp/v2build.rc"
}

step_waitbuild() {
    local waited=0
    while [ ! -f /tmp/v2build.rc ] && [ $waited -lt "$BUILD_TIMEOUT" ]; do sleep 5; waited=$((waited + 5)); done
    tail -n 30 "$RES/bgbuild.out"
    [ -f /tmp/v2build.rc ] || { echo "the background build has not ended after ${waited}s"; return 1; }
    echo "background build: exit $(cat /tmp/v2build.rc) (waited ${waited}s here)"
    return "$(cat /tmp/v2build.rc)"
}

run_step() {
    local stage=$1 name arg rc start
    IFS=: read -r name arg <<<"$stage"
    echo "=== $stage ($(date +%T), boot $(boot_id | cut -c1-8))"
    start=$SECONDS
    case $name in
        part) step_part "$arg" ;;
        unpack) step_unpack ;;
        build) step_build ;;
        bgbuild) step_bgbuild ;;
        waitbuild) step_waitbuild ;;
        import) step_import ;;
        barrier) step_barrier "${arg:-2}" ;;
        ep) step_ep "${arg:-2}" ;;
        coexist) step_coexist ;;
        bench) step_bench "${arg:-2}" ;;
        *) echo "unknown step $stage"; false ;;
    esac > >(tee "$RES/$(echo "$stage" | tr ':' '-').log") 2>&1
    rc=$?
    echo "=== $stage: exit $rc after $((SECONDS - start)) s" | tee -a "$RES/steps.txt"
    cd "$ROOT"
    [ -n "${OUT:-}" ] && tar -czf "$OUT/v2res.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
    return $rc
}

failed=0
for stage in "$@"; do
    if [ "$stage" = all ]; then
        for s in part:3 unpack build import; do
            run_step "$s" || { failed=$((failed + 1)); break; }
        done
    else
        run_step "$stage" || failed=$((failed + 1))
    fi
done
exit $failed
