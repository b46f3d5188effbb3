# 2x H200, main at 51f241f (+ call_stamps ll): DeepEP's own tests on pyep, then pyep's whole suite, one rank a GPU
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=420
mkdir -p $RES
cp .device/s9.sh $RES/run.sh
bench/device/run.sh setup
for t in test_intranode.py test_low_latency.py; do
  s=$SECONDS; timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-$t-2.log $t --num-processes 2 > /dev/null 2>&1
  echo "=== pyep in DeepEP's $t --num-processes 2: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
done
tar -czf $OUT/res.tgz -C /tmp res
SUITE_TESTS="--durations=25 -rs tests" bench/device/run.sh suite:2
cat $RES/stages.txt
