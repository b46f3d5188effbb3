# One H200: layout kernel variants, second round (exp/layout_y.cu: loads, staging, block sizes, shared atomics)
source .device/env.sh
export RES=/tmp/res
mkdir -p $RES; cp .device/s15.sh $RES/run15.sh; cp -r exp $RES/exp-src; rm -rf $RES/exp-src/cubin
for r in 2 8; do timeout 150 python3 exp/layout_bench.py bench $r 2>&1 | tee $RES/layout-bench-R$r.log; done
timeout 200 ncu --metrics gpu__time_duration.sum --kernel-name pyep_layout python3 exp/layout_bench.py ncu 2 > $RES/ncu-times.log 2>&1
tar -czf $OUT/res.tgz -C /tmp res
