source .device/env.sh
export RES=/tmp/res
mkdir -p $RES
(cd /tmp && python3 -c "import pyep") 2>/dev/null || DEEPEP_SRC=/nonexistent bench/device/run.sh setup > /dev/null 2>&1
chain() { n=$1; shift; timeout 90 torchrun --nproc-per-node 1 bench/device/ll_chain.py --reps 4 --json $RES/chain1-$n.json "$@" 2>&1 | grep -v "^W11\|_warn_once\|compiled\|^\*\*\*\|OMP_NUM\|UserWarning" > $RES/chain1-$n.log; echo "== $n $*"; grep -h "harness's figure" $RES/chain1-$n.log | cut -c1-250; }
chain now --trace-from now
chain harness --trace-from harness
chain early --trace-from early
chain harness-fresh --trace-from harness --fresh
chain early-fresh --trace-from early --fresh
tar -czf $OUT/res.tgz -C /tmp res
