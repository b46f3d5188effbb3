source .device/env.sh
export RES=/tmp/res
mkdir -p $RES
bench/device/run.sh setup > /dev/null 2>&1
root=$(pwd)
chain() { n=$1; shift; timeout 90 torchrun --nproc-per-node 2 bench/device/ll_chain.py --json $RES/chain2-$n.json "$@" 2>&1 | grep -v "^W11\|_warn_once\|compiled\|^\*\*\*\|OMP_NUM\|UserWarning" > $RES/chain2-$n.log; echo "== $n $*"; grep -h "harness's figure" $RES/chain2-$n.log | cut -c1-250; }
chain early --reps 3 --trace-from early
chain harness --reps 3 --trace-from harness
while kill -0 "$(cat /tmp/deepep-build.pid)" 2>/dev/null; do sleep 2; done
(cd /tmp/deepep/tests && PYTHONPATH=/tmp/deepep:$PYTHONPATH timeout 120 python3 $root/bench/device/deepep_ll_trace.py --num-processes 2 --out $RES/deepep-traces > $RES/deepep-harness-traced.log 2>&1); echo "deepep traced exit $?"
grep -h "Dispatch bandwidth\|send/recv" $RES/deepep-harness-traced.log | cut -c1-160
python3 bench/device/ll_chain.py --traces $RES/deepep-traces/harness-rank0-1.json $RES/deepep-traces/harness-rank1-1.json > $RES/deepep-harness-traces.txt 2>&1
grep -h "harness's figure" $RES/deepep-harness-traces.txt | cut -c1-250; grep -A3 "^dispatch" $RES/deepep-harness-traces.txt | tail -2
cd /tmp/res/deepep-traces && gzip -9 *.json; cd $root
tar -czf $OUT/res.tgz -C /tmp res
