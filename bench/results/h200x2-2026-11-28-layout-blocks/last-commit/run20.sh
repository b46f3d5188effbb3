# 2x H200, the last commit: the layout/normal and low-latency test files one rank a GPU, DeepEP's test_low_latency.py on pyep
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=220
mkdir -p $RES; cp .device/s20.sh $RES/run20.sh
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > $RES/setup.log 2>&1
rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
s=$SECONDS; timeout 100 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/deepep-low-latency.log test_low_latency.py --num-processes 2 > /dev/null 2>&1
echo "=== DeepEP test_low_latency.py on pyep: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
grep -h "Dispatch + combine\|dispatch bandwidth\|Dispatch bandwidth\|Combine bandwidth" $RES/deepep-low-latency.log | head -6
tar -czf $OUT/res.tgz -C /tmp res
export SUITE_TESTS="tests/test_layouts.py tests/test_normal.py tests/test_cuda_normal.py tests/test_plans.py tests/test_normal_args.py tests/test_low_latency.py tests/test_low_latency_logfmt.py"
bench/device/run.sh suite:2
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt; grep -h "passed\|failed" $RES/suite-2-rank*.log | tail -3
