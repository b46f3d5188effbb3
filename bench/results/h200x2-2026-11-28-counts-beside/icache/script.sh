#!/usr/bin/env bash
# 2x H200, the instruction-fetch question: unhooked calls timed in sequences (dc as DeepEP's harness, ddc, d), the
# timeline with a second dispatch right after the first (--twice), and DeepEP's test_low_latency.py with the cast's
# batch at 8 (default) and 2 (-DPYEP_LL_CAST_BATCH=2: 22 KB less code), alternating
source .device/env.sh
export RES=/tmp/res; mkdir -p $RES
DEEPEP_SRC=/nonexistent bench/device/run.sh setup >$RES/setup.log 2>&1; tail -1 $RES/setup.log
rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
for v in cb8 cb2; do
  f=""; [ $v = cb2 ] && f="-DPYEP_LL_CAST_BATCH=2"
  PYEP_JIT_FLAGS="$f" PYEP_TIMEOUT_S=60 timeout 120 torchrun --nproc-per-node 2 bench/device/ll_profile.py --kineto dc,ddc,d,dcc --iters 10 > $RES/kineto-$v.txt 2>&1; echo "kineto $v: exit $?"
  grep -A12 "^ll_profile --kineto" $RES/kineto-$v.txt
  tar -czf $OUT/res.tgz -C /tmp res
done
PYEP_TIMEOUT_S=60 timeout 100 torchrun --nproc-per-node 2 bench/device/ll_profile.py --timeline --twice --iters 20 > $RES/timeline-twice.txt 2>&1; echo "timeline twice: exit $?"
grep -E -A11 "^dispatch (send|recv)" $RES/timeline-twice.txt | grep -v "^  phase" | head -50
tar -czf $OUT/res.tgz -C /tmp res
for v in cb8 cb2 cb8 cb2; do
  f=""; [ $v = cb2 ] && f="-DPYEP_LL_CAST_BATCH=2"
  PYEP_JIT_FLAGS="$f" timeout 90 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/ll.log test_low_latency.py --num-processes 2 >/dev/null 2>&1; echo "LL harness $v: exit $?"
  grep -E "Dispatch bandwidth|send/recv" $RES/ll.log | head -4
  cp $RES/ll.log $RES/ll-$(date +%s)-$v.log
  tar -czf $OUT/res.tgz -C /tmp res
done
