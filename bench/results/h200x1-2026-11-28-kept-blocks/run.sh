# one H200, 51f241f: the LL files (the kept blocks) with ranks sharing the GPU, MPS on and off; hostpath --ll; DeepEP's LL test on pyep
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=300
mkdir -p $RES
cp .device/s7.sh $RES/run.sh
LL="tests/test_low_latency.py tests/test_low_latency_graphs.py tests/test_runtime_sequence.py"
DEEPEP_SRC=/nonexistent bench/device/run.sh setup
SUITE_TESTS="$LL" bench/device/run.sh suite:4:mps suite:2:mps suite:2 suite:4
bench/device/run.sh hostpath:2
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
cp -r .deepep /tmp/deepep
timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-4-mps.log test_low_latency.py --num-processes 4 > /dev/null 2>&1; echo "deepep ll 4 mps exit $?" >> $RES/stages.txt
timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-2-mps.log test_low_latency.py --num-processes 2 > /dev/null 2>&1; echo "deepep ll 2 mps exit $?" >> $RES/stages.txt
echo quit | nvidia-cuda-mps-control; sleep 1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
tar -czf $OUT/res.tgz -C /tmp res
cat $RES/stages.txt
