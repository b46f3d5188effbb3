source .device/env.sh
export RES=/tmp/res
mkdir -p $RES
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > /dev/null 2>&1
root=$(pwd)
cp -r .deepep /tmp/deepep
KEEP=1 DRY_RUN=1 bench/deepep/run_deepep_test.sh /tmp/deepep/tests /tmp/dry.log test_low_latency.py --num-processes 2 > /dev/null 2>&1
work=$(ls -d /tmp/deepep-tests.* | head -1)
(cd $work && PYTHONPATH=$root/bench/deepep:$PYTHONPATH timeout 150 python3 $root/bench/device/deepep_ll_trace.py --num-processes 2 --out $RES/traces > $RES/harness-traced.log 2>&1); echo "traced exit $?"
grep -h "Dispatch bandwidth\|send/recv" $RES/harness-traced.log | cut -c1-160
python3 bench/device/ll_chain.py --traces $RES/traces/harness-rank0-1.json $RES/traces/harness-rank1-1.json | tee $RES/harness-traces.txt
timeout 100 torchrun --nproc-per-node 2 bench/device/ll_chain.py --reps 4 --json $RES/chain-seed1.json 2>&1 | grep -v "^W11\|_warn_once\|compiled\|^\*\*\*\|OMP_NUM\|UserWarning" > $RES/chain-seed1.log
grep -A1 "^dispatch\|^combine" $RES/chain-seed1.log
cd /tmp/res/traces && gzip -9 *.json; cd $root
tar -czf $OUT/res.tgz -C /tmp res
