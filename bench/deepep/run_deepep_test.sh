#!/usr/bin/env bash
# Runs one of DeepEP's own tests, unmodified, on pyep.
#
# Usage: run_deepep_test.sh DEEPEP_TESTS_DIR LOG [TEST_SCRIPT [ARGS...]]
#   DEEPEP_TESTS_DIR  DeepEP's tests/ directory (V1, e.g. a checkout's tests/); it is copied, never changed
#   LOG               where the test's output is written (also shown on the terminal)
#   TEST_SCRIPT       default test_intranode.py; ARGS go to it, e.g. --num-processes 2
# Example: bench/deepep/run_deepep_test.sh /tmp/deepep/tests /tmp/intranode.log test_intranode.py --num-processes 2
#
# `import deep_ep` gives pyep (PYTHONPATH=bench/deepep). The tests are copied into a temporary directory because
# Python puts a script's own directory first on sys.path: `from utils import init_dist` always finds the utils.py
# beside the script. When the ranks (--num-processes, DeepEP's default 8) outnumber the GPUs, the copy's utils.py
# gets shared_gpu_init_dist.py appended, whose init_dist (a gloo group, PYEP_BACKEND=cuda, GPU rank % count)
# replaces DeepEP's; nothing else changes. The exit status is the test's.
#
# Environment: NUM_GPUS overrides the GPU count torch reports; DRY_RUN=1 prepares the copy and prints the command
# without running it; KEEP=1 keeps the copy (a dry run always does). MASTER_ADDR/MASTER_PORT as DeepEP reads them.
set -euo pipefail

die() { echo "run_deepep_test.sh: $*" >&2; exit 2; }

[ $# -ge 2 ] || die "usage: $0 DEEPEP_TESTS_DIR LOG [TEST_SCRIPT [ARGS...]]"
tests_dir=$1
log=$2
shift 2
script=${1:-test_intranode.py}
if [ $# -ge 1 ]; then shift; fi
args=("$@")

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
[ -d "$tests_dir" ] || die "$tests_dir: not a directory (expected DeepEP's tests/)"
[ -f "$tests_dir/$script" ] || die "$tests_dir/$script: no such test"
[ -f "$tests_dir/utils.py" ] || die "$tests_dir/utils.py: missing (DeepEP's tests import init_dist from it)"

# The ranks the test spawns: --num-processes N or --num-processes=N, else DeepEP's default.
num_processes=8
for ((i = 0; i < $#; i++)); do
    case ${args[i]} in
        --num-processes) [ $((i + 1)) -lt $# ] || die "--num-processes needs a value"; num_processes=${args[i + 1]} ;;
        --num-processes=*) num_processes=${args[i]#--num-processes=} ;;
    esac
done
[[ $num_processes =~ ^[1-9][0-9]*$ ]] || die "--num-processes $num_processes: expected a positive integer"

gpus=${NUM_GPUS:-$("$python" -c 'import torch; print(torch.cuda.device_count())')}
[[ $gpus =~ ^[0-9]+$ ]] || die "GPU count $gpus: expected a number"
[ "$gpus" -gt 0 ] || die "no GPU: DeepEP's tests need CUDA GPUs"

work=$(mktemp -d "${TMPDIR:-/tmp}/deepep-tests.XXXXXX")
if [ "${KEEP:-0}" != 1 ] && [ "${DRY_RUN:-0}" != 1 ]; then
    trap 'rm -rf "$work"' EXIT
fi
cp -R "$tests_dir"/. "$work"/
rm -rf "$work/__pycache__"

export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# Checked where the test runs (its directory first on sys.path), not here: a checkout's pyep/ is Go sources.
pyep_at=$(cd "$work" && "$python" -c 'import deep_ep, pyep; assert deep_ep is pyep; print(pyep.__file__)' 2>"$work/.preflight") ||
    die "import deep_ep does not give pyep with PYTHONPATH=$PYTHONPATH (is pyep installed? pip install .): $(tail -n 1 "$work/.preflight")"
rm -f "$work/.preflight"

mps_dir=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
mps=off
[ -e "$mps_dir/control" ] && mps="on ($mps_dir)"
if [ "$num_processes" -gt "$gpus" ]; then
    { echo; cat "$here/shared_gpu_init_dist.py"; } >> "$work/utils.py"
    note="$num_processes ranks on $gpus GPU(s): ranks share GPUs (gloo group, PYEP_BACKEND=cuda; init_dist replaced); MPS $mps"
else
    note="$num_processes ranks on $gpus GPU(s): a GPU a rank, DeepEP's init_dist (NCCL)"
fi

mkdir -p "$(dirname "$log")"
log=$(cd "$(dirname "$log")" && pwd)/$(basename "$log")  # absolute: the test runs in the copy
cmd=("$python" "$script" ${args[@]+"${args[@]}"})
{
    echo "run_deepep_test.sh: $note"
    echo "run_deepep_test.sh: deep_ep is pyep from $pyep_at"
    echo "run_deepep_test.sh: in $work: PYTHONPATH=$PYTHONPATH ${cmd[*]}"
} | tee "$log"
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "run_deepep_test.sh: dry run: not started; the copy stays in $work" | tee -a "$log"
    exit 0
fi
cd "$work"
set +e
"${cmd[@]}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
set -e
echo "run_deepep_test.sh: $script exited with status $status" | tee -a "$log"
exit "$status"
