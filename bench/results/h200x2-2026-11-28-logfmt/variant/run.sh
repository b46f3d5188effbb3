# 2x H200: LogFMT-10 with the division-free encoder and the receive's loads in flight at once: DeepEP's test --use-logfmt on pyep, pyep's LogFMT tests
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=200
mkdir -p $RES
cp .device/s13.sh $RES/run.sh
DEEPEP_SRC=/nonexistent bench/device/run.sh setup
cp -r .deepep /tmp/deepep
for a in --use-logfmt ""; do
s=$SECONDS; timeout 150 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-2$a.log test_low_latency.py --num-processes 2 $a > /dev/null 2>&1
echo "=== pyep in DeepEP's test_low_latency.py --num-processes 2 $a: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
grep -h "Dispatch bandwidth\|send/recv" $RES/pyep-test_low_latency.py-2$a.log
tar -czf $OUT/res.tgz -C /tmp res
done
SUITE_TESTS="-rs tests/test_low_latency_logfmt.py" bench/device/run.sh suite:2
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt
