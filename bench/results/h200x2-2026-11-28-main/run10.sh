# 2x H200 (the machine of s9 when still warm): DeepEP V1 itself in its tests, then pyep.bench normal and LL beside DeepEP V1 and NCCL
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=280
mkdir -p $RES
cp .device/s10.sh $RES/run10.sh
if ! (cd /tmp && python3 -c 'import pyep' 2>/dev/null); then echo "fresh machine: setup again"; bench/device/run.sh setup; fi
bench/device/run.sh bench:2 ll-bench:2
PYTHONPATH=/tmp/deepep python3 -c 'import deep_ep' && for t in test_intranode.py test_low_latency.py; do
  s=$SECONDS; (cd /tmp/deepep/tests && PYTHONPATH=/tmp/deepep timeout 150 python3 $t --num-processes 2) > $RES/deepep-$t-2.log 2>&1
  echo "=== DeepEP V1 itself: $t --num-processes 2: exit $? after $((SECONDS - s)) s" | tee -a $RES/stages.txt
done
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt
