# one H200: the low-latency calls' Python split at its steps (call_stamps ll-*), and the Python layer with the core stubbed on cuda
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=300
mkdir -p $RES
cp .device/s8.sh $RES/run.sh
DEEPEP_SRC=/nonexistent bench/device/run.sh setup stamps:ll-dispatch stamps:ll-combine
(cd /tmp && python3 -m pyep.bench.overhead --device cuda --hidden 7168 --ll-tokens 128 --experts 288 --calls ll_dispatch,ll_combine) 2>&1 | tee $RES/overhead-cuda.log
tar -czf $OUT/res.tgz -C /tmp res
