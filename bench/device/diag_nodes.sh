#!/usr/bin/env bash
# The across-nodes low-latency tests alone (tests/test_low_latency_nodes.py -k across_nodes), N ranks (default 2), once
# per variant of NVSHMEM's settings: with (NVSHMEM_REMOTE_TRANSPORT=none, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo, as
# run.sh's nodes stage), without, transport (the first alone), ifname (the second alone). DIAG_VARIANTS picks them,
# DIAG_TIMEOUT is PYEP_TIMEOUT_S (45), DIAG_STAGE each variant's limit (150 s), DIAG_DEBUG NVSHMEM_DEBUG (WARN),
# DIAG_K the tests. Logs in $RES/<variant>.log and $RES/<variant>/ (a rank a file); the RDMA devices in $RES/ib.txt.
set -u
RES=${RES:-/tmp/res}; mkdir -p $RES
ls -l /sys/class/infiniband > $RES/ib.txt 2>&1; nvidia-smi topo -m > $RES/topo.txt 2>&1
t=tests/test_low_latency_nodes.py
run() { # name env...
  local name=$1; shift
  ( export "$@"; PYEP_TIMEOUT_S=${DIAG_TIMEOUT:-45} NVSHMEM_DEBUG=${DIAG_DEBUG:-WARN} PYEP_TEST_DEVICE=cuda timeout ${DIAG_STAGE:-150} \
    torchrun --nproc-per-node ${N:-2} --log-dir $RES/$name --redirects 3 --tee 3 -m pytest -x -q -rfE -p no:cacheprovider $t -k "${DIAG_K:-across_nodes}" ) > $RES/$name.log 2>&1
  echo "== $name rc=$?"; tail -n 6 $RES/$name.log
}
for v in ${DIAG_VARIANTS:-with without}; do
  case $v in
    with) run with NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo ;;
    without) run without DIAG_NONE=1 ;;
    transport) run transport NVSHMEM_REMOTE_TRANSPORT=none ;;
    ifname) run ifname NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo ;;
  esac
done
