# 2x H200: pyep.bench --quick, pyep only, normal ops (the layout kernel of blocks of 128 among them), one rank a GPU
source .device/env.sh
export RES=/tmp/res
mkdir -p $RES; cp .device/s19.sh $RES/run19.sh
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > $RES/setup.log 2>&1
timeout 300 python3 -m pyep.bench --quick --nprocs 2 --impls pyep,baseline --ops layout,dispatch_bf16,dispatch_fp8,dispatch_cached,combine_bf16 --out $RES/bench 2>&1 | grep -v IBGDA | tr -d '\r' | tee $RES/bench.log | tail -25
tar -czf $OUT/res.tgz -C /tmp res
