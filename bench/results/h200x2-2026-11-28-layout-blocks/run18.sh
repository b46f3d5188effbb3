# 2x H200: the working tree's layout (blocks of 128, pairs a load, shared-memory atomics) in DeepEP's test_intranode.py on pyep, three runs, one rank a GPU; hostpath once
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=200
mkdir -p $RES; cp .device/s18.sh $RES/run18.sh
lscpu | grep -E "Model name|^CPU\(s\)" | tee $RES/cpu.txt
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > $RES/setup.log 2>&1
rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
for i in 1 2 3; do
  s=$SECONDS; timeout 150 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/deepep-intranode-$i.log test_intranode.py --num-processes 2 > /dev/null 2>&1
  echo "=== DeepEP test_intranode.py on pyep, run $i: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
  grep -h "layout\] Kernel\|Best dispatch\|Best combine" $RES/deepep-intranode-$i.log | head -8
done
tar -czf $OUT/res.tgz -C /tmp res
timeout 120 bench/device/run.sh hostpath:1 > /dev/null 2>&1; grep -A3 "^call" $RES/hostpath-1.log | head -4
tar -czf $OUT/res.tgz -C /tmp res
