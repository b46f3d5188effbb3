source .device/env.sh
export RES=/tmp/res
mkdir -p $RES
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > /dev/null 2>&1
chain() { timeout 100 torchrun --nproc-per-node 2 bench/device/ll_chain.py "$@" 2>&1 | grep -v "^W11\|_warn_once\|compiled\|^\*\*\*\|OMP_NUM\|UserWarning" ; }
chain --reps 6 --json $RES/chain-a.json | tee $RES/chain-a.log
cp -r .deepep /tmp/deepep
timeout 120 bench/deepep/run_deepep_test.sh /tmp/deepep/tests $RES/pyep-test_low_latency.py-2.log test_low_latency.py --num-processes 2 > /dev/null 2>&1; echo "deepep ll exit $?"
grep -h "Dispatch bandwidth\|send/recv" $RES/pyep-test_low_latency.py-2.log | cut -c1-160
chain --reps 6 --json $RES/chain-b.json > $RES/chain-b.log 2>&1
tar -czf $OUT/res.tgz -C /tmp res
