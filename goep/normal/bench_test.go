package normal

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkRound measures notify+dispatch and combine with all ranks as
// goroutines of one process (so it measures the package, not shared-memory
// effects between processes). Bytes are dispatched payload bytes.
func BenchmarkRound(b *testing.B) {
	for _, bc := range []struct {
		R, T, hidden int
		cfg          Config
	}{
		{8, 4096, 7168, Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256}},
		{8, 4096, 7168, Config{NumSMs: 8, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 64}},
		{2, 4096, 7168, Config{NumSMs: 24, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 256}},
	} {
		b.Run(fmt.Sprintf("R%d_T%d_H%d_sms%d_recv%d", bc.R, bc.T, bc.hidden, bc.cfg.NumSMs, bc.cfg.NumMaxNVLChunkedRecvTokens), func(b *testing.B) {
			tokens := make([]int, bc.R)
			for r := range tokens {
				tokens[r] = bc.T
			}
			sc := scenario{R: bc.R, E: 32 * bc.R, K: 8, tokens: tokens, hiddenBytes: 2 * bc.hidden, cfg: bc.cfg, noRecvRank: -1}
			cc := combineCase{dtype: BFloat16, hidden: bc.hidden}
			s := newSim(b, bc.R, scenarioBytes(&sc, cc), 100*time.Second)
			in := makeInputs(rand.New(rand.NewPCG(1, 1)), &sc)
			var moved int64
			out, errs := runDispatch(s, &sc, in)
			requireNoErrors(b, errs)
			for r := range out {
				moved += int64(len(out[r].srcIdx) * sc.hiddenBytes)
			}
			b.SetBytes(moved)
			b.ResetTimer()
			var tDisp, tComb time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				out, errs = runDispatch(s, &sc, in)
				requireNoErrors(b, errs)
				t1 := time.Now()
				errs = s.each(func(r int, d *Domain) error {
					o := &out[r]
					return Combine(d, &CombineArgs{Config: sc.cfg, DType: BFloat16, Hidden: bc.hidden, NumTopk: sc.K, NumTokens: bc.T,
						X: o.x, TopkWeights: o.weights, SrcIdx: o.srcIdx, RankPrefixMatrix: o.rpm, ChannelPrefixMatrix: o.rcpm2,
						SendHead: o.sendHead, CombinedX: alignedBytes(bc.T * bc.hidden * 2), CombinedTopkWeights: make([]float32, bc.T*sc.K)})
				})
				requireNoErrors(b, errs)
				tDisp += t1.Sub(t0)
				tComb += time.Since(t1)
			}
			b.ReportMetric(float64(tDisp.Milliseconds())/float64(b.N), "dispatch-ms")
			b.ReportMetric(float64(tComb.Milliseconds())/float64(b.N), "combine-ms")
		})
	}
}
