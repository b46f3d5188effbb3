# 2x H200: LogFMT-10 combine rows (use_logfmt): DeepEP's test_low_latency.py --use-logfmt on pyep and on DeepEP V1, pyep's LL files
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=300
mkdir -p $RES
cp .device/s12.sh $RES/run.sh
bench/device/run.sh setup
s=$SECONDS; timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-2-logfmt.log test_low_latency.py --num-processes 2 --use-logfmt > /dev/null 2>&1
echo "=== pyep in DeepEP's test_low_latency.py --num-processes 2 --use-logfmt: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
tail -n 8 $RES/pyep-test_low_latency.py-2-logfmt.log
tar -czf $OUT/res.tgz -C /tmp res
SUITE_TESTS="-rs tests/test_low_latency.py tests/test_low_latency_logfmt.py tests/test_low_latency_graphs.py tests/test_low_latency_nodes.py" bench/device/run.sh suite:2
[ -f /tmp/deepep-build.pid ] && while kill -0 "$(cat /tmp/deepep-build.pid)" 2>/dev/null; do sleep 2; done
s=$SECONDS; (cd /tmp/deepep/tests && PYTHONPATH=/tmp/deepep timeout 150 python3 test_low_latency.py --num-processes 2 --use-logfmt) > $RES/deepep-test_low_latency.py-2-logfmt.log 2>&1
echo "=== DeepEP V1 itself: test_low_latency.py --num-processes 2 --use-logfmt: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
tail -n 8 $RES/deepep-test_low_latency.py-2-logfmt.log
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt
