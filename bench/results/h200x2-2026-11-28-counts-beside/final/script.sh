#!/usr/bin/env bash
# 2x H200, the session's final kernels (the dispatch receive's counts beside the done words): DeepEP's own
# test_intranode.py and test_low_latency.py on pyep, python -m pyep.bench --quick (normal and LL rows) beside NCCL and
# DeepEP V1 (built here), then pyep's whole suite, one rank a GPU
source .device/env.sh
export RES=/tmp/res; mkdir -p $RES
bench/device/run.sh setup >$RES/setup.log 2>&1; tail -2 $RES/setup.log
for t in test_intranode.py test_low_latency.py; do
  timeout 150 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-$t-2.log $t --num-processes 2 >/dev/null 2>&1; echo "DeepEP's $t on pyep: exit $?"
  grep -E "Dispatch bandwidth|send/recv|Best|layout|passed" $RES/pyep-$t-2.log | head -12
  tar -czf $OUT/res.tgz -C /tmp res
done
STAGE_TIMEOUT=150 bench/device/run.sh bench:2 > $RES/bench-stage.txt 2>&1; echo "bench: exit $?"
grep -E "^(pyep|deepep|baseline) " $RES/bench-stage.txt | head -30
tar -czf $OUT/res.tgz -C /tmp res
STAGE_TIMEOUT=330 bench/device/run.sh suite:2 2>&1 | grep -E "passed|failed|error|exit" | tail -4
tar -czf $OUT/res.tgz -C /tmp res
