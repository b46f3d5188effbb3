# 2x H200: the host time of each call on this kind: hostpath (one rank, GPU 0), then pyep.bench's host columns with 100 host iterations (pyep only)
source .device/env.sh
export RES=/tmp/res STAGE_TIMEOUT=200
mkdir -p $RES
cp .device/s11.sh $RES/run11.sh
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | tee $RES/cpu.txt
DEEPEP_SRC=/nonexistent bench/device/run.sh setup hostpath:2
python3 -m pyep.bench --quick --nprocs 2 --impls pyep --host-iters 100 --out $RES/bench-host100 2>&1 | grep -v IBGDA | tr -d '\r' | tee $RES/bench-host100.log
CUDA_VISIBLE_DEVICES=0 python3 -m pyep.bench --quick --nprocs 1 --impls pyep --host-iters 100 --out $RES/bench-host100-1rank 2>&1 | grep -v IBGDA | tr -d '\r' | tee $RES/bench-host100-1rank.log
tar -czf $OUT/res.tgz -C /tmp res
