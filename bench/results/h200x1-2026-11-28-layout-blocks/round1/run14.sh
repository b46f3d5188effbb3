# One H200: layout kernel variants (exp/, cubins built here with NVRTC) timed and under ncu; then the LogFMT test with ranks sharing the GPU, MPS off and on
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=200
mkdir -p $RES; cp .device/s14.sh $RES/run14.sh; cp -r exp $RES/exp-src
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $RES/gpu.txt
for r in 2 8; do timeout 120 python3 exp/layout_bench.py bench $r 2>&1 | tee $RES/layout-bench-R$r.log; done
timeout 150 ncu --metrics gpu__time_duration.sum python3 exp/layout_bench.py ncu 2 > $RES/ncu-times.log 2>&1
timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy python3 exp/layout_bench.py ncu 2 head512 early_vec_u32 loadrow empty > $RES/ncu-sections.log 2>&1
tar -czf $OUT/res.tgz -C /tmp res
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > $RES/setup.log 2>&1
export SUITE_TESTS="tests/test_low_latency_logfmt.py"
bench/device/run.sh suite:2 suite:4:mps suite:2:mps suite:4
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt 2>/dev/null
grep -h "passed\|failed" $RES/suite-*/*rank0* 2>/dev/null | tail -8
