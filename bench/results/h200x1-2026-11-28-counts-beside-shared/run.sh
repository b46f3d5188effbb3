# one H200: the LL files with ranks sharing the GPU (MPS on, off), DeepEP's LL test on pyep (4 ranks, MPS), emulated nodes
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=300
mkdir -p $RES
LL="tests/test_low_latency.py tests/test_low_latency_graphs.py tests/test_low_latency_nodes.py"
DEEPEP_SRC=/nonexistent bench/device/run.sh setup
SUITE_TESTS="$LL" bench/device/run.sh suite:4:mps suite:4 suite:2
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
cp -r .deepep /tmp/deepep
timeout 200 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-4-mps.log test_low_latency.py --num-processes 4 > /dev/null 2>&1; echo "deepep ll 4 mps exit $?" >> $RES/stages.txt
echo quit | nvidia-cuda-mps-control; sleep 1
bench/device/run.sh nodes:4:2
tar -czf $OUT/res.tgz -C /tmp res
