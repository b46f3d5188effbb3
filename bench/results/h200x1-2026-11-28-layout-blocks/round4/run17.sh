# One H200: the layout kernel of the working tree (blocks of 128, pairs of indices a load, shared-memory atomics)
# against c768048's: the kernels alone (exp/layout_bench.py, ncu), the layout through pyep in DeepEP's harness loop
# (exp/layout_ab.py), the layout/normal tests with 1, 2 (MPS off) and 4 (MPS on) ranks, DeepEP's test_intranode.py on pyep (2 ranks sharing)
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=240
mkdir -p $RES; cp .device/s17.sh $RES/run17.sh; cp -r exp $RES/exp-src; rm -rf $RES/exp-src/cubin
for r in 2 8; do timeout 150 python3 exp/layout_bench.py bench $r 2>&1 | grep -v "^check .*: ok" | tee $RES/layout-bench-R$r.log; done
timeout 200 ncu --metrics gpu__time_duration.sum --kernel-name pyep_layout python3 exp/layout_bench.py ncu 2 > $RES/ncu-times.log 2>&1
tar -czf $OUT/res.tgz -C /tmp res
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > $RES/setup.log 2>&1
for i in 1 2 3; do (cd /tmp && timeout 100 python3 $OLDPWD/exp/layout_ab.py) 2>&1 | grep -v IBGDA | tee -a $RES/layout-ab.log; done
export SUITE_TESTS="tests/test_layouts.py tests/test_normal.py tests/test_cuda_normal.py tests/test_plans.py tests/test_normal_args.py"
bench/device/run.sh suite:1 suite:2 suite:4:mps
rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
s=$SECONDS; timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/deepep-intranode-2.log test_intranode.py --num-processes 2 > /dev/null 2>&1
echo "=== DeepEP test_intranode.py on pyep, 2 ranks sharing the GPU: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt; grep -h "passed\|failed" $RES/suite-*-rank0.log | tail -5
