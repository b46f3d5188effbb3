#!/usr/bin/env bash
# 2x H200: the dispatch receive reads the flags beside the done words (default) against -DPYEP_LL_COUNTS_BESIDE=0
# (after them, as before), DeepEP's test_low_latency.py alternating three times; unhooked calls timed in sequences;
# pyep's LL test files (timeouts and masked ranks included)
source .device/env.sh
export RES=/tmp/res; mkdir -p $RES
DEEPEP_SRC=/nonexistent bench/device/run.sh setup >$RES/setup.log 2>&1; tail -1 $RES/setup.log
rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
for v in new old new old new old; do
  f=""; [ $v = old ] && f="-DPYEP_LL_COUNTS_BESIDE=0"
  PYEP_JIT_FLAGS="$f" timeout 90 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/ll.log test_low_latency.py --num-processes 2 >/dev/null 2>&1; echo "LL harness $v: exit $?"
  grep -E "Dispatch bandwidth|send/recv" $RES/ll.log | head -4
  cp $RES/ll.log $RES/ll-$(date +%s)-$v.log
  tar -czf $OUT/res.tgz -C /tmp res
done
for v in new old; do
  f=""; [ $v = old ] && f="-DPYEP_LL_COUNTS_BESIDE=0"
  PYEP_JIT_FLAGS="$f" PYEP_TIMEOUT_S=60 timeout 100 torchrun --nproc-per-node 2 bench/device/ll_profile.py --kineto dc,dcc --iters 10 > $RES/kineto-$v.txt 2>&1; echo "kineto $v: exit $?"
  grep -A8 "^ll_profile --kineto" $RES/kineto-$v.txt
done
tar -czf $OUT/res.tgz -C /tmp res
SUITE_TESTS="tests/test_low_latency.py tests/test_low_latency_graphs.py" PYEP_TIMEOUT_S=60 STAGE_TIMEOUT=130 bench/device/run.sh suite:2 2>&1 | grep -E "passed|failed|error|exit" | tail -4
tar -czf $OUT/res.tgz -C /tmp res
