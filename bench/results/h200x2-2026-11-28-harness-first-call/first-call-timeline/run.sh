source .device/env.sh
export RES=/tmp/res
mkdir -p $RES
DEEPEP_SRC=/nonexistent bench/device/run.sh setup > /dev/null 2>&1
chain() { n=$1; shift; timeout 90 torchrun --nproc-per-node 2 bench/device/ll_chain.py --json $RES/chain2-$n.json "$@" 2>&1 | grep -v "^W11\|_warn_once\|compiled\|^\*\*\*\|OMP_NUM\|UserWarning" > $RES/chain2-$n.log; echo "== $n $*"; sed -n '/timeline-first/,/^dispatch: late/p' $RES/chain2-$n.log | head -70; grep -h "harness's figure" $RES/chain2-$n.log | head -1 | cut -c1-250; }
chain timeline-harness --reps 1 --trace-from harness --timeline-first
chain timeline-early --reps 1 --trace-from early --timeline-first
tar -czf $OUT/res.tgz -C /tmp res
