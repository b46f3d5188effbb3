//go:build linux

package normal

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const childEnv = "PYEP_NORMAL_TEST_CHILD"

// multiRounds is what every process of TestMultiProcess runs: small rounds
// with tiny rings, one larger round, and a call one rank skips.
func multiRounds(R int) []struct {
	sc scenario
	cc combineCase
} {
	tokens := func(n int) []int {
		t := make([]int, R)
		for r := range t {
			t[r] = n + 7*r
		}
		return t
	}
	return []struct {
		sc scenario
		cc combineCase
	}{
		{scenario{name: "tiny rings", R: R, E: 4 * R, K: 4, tokens: tokens(300), hiddenBytes: 64, scalesBytes: 8,
			cfg: Config{NumSMs: 4, NumMaxNVLChunkedSendTokens: 2, NumMaxNVLChunkedRecvTokens: 4}, noRecvRank: -1},
			combineCase{dtype: BFloat16, hidden: 32, nbias: 1}},
		{scenario{name: "hidden 7168", R: R, E: 8 * R, K: 8, tokens: tokens(128), hiddenBytes: 7168 * 2,
			cfg: Config{NumSMs: 8, NumMaxNVLChunkedSendTokens: 6, NumMaxNVLChunkedRecvTokens: 16}, noRecvRank: -1},
			combineCase{dtype: BFloat16, hidden: 7168, nbias: 2}},
		{scenario{name: "worst", R: R, E: 2 * R, K: 2, tokens: tokens(50), hiddenBytes: 30, align: 128, worst: 1000,
			cfg: Config{NumSMs: 2, NumMaxNVLChunkedSendTokens: 3, NumMaxNVLChunkedRecvTokens: 8}, noRecvRank: -1},
			combineCase{dtype: Float16, hidden: 15}},
	}
}

func multiBytes(R int) int64 {
	var n int64
	for _, rd := range multiRounds(R) {
		n = max(n, scenarioBytes(&rd.sc, rd.cc))
	}
	return align(n, 4096)
}

// TestMultiProcess runs every rank as a separate process of this test
// binary over one MAP_SHARED file, as the real backend does.
func TestMultiProcess(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("child")
	}
	sizes := []int{2, 8}
	if testing.Short() {
		sizes = []int{3}
	}
	for _, R := range sizes {
		t.Run(fmt.Sprintf("R%d", R), func(t *testing.T) {
			numBytes := multiBytes(R)
			dir := "/dev/shm"
			if st, err := os.Stat(dir); err != nil || !st.IsDir() {
				dir = t.TempDir()
			}
			f, err := os.CreateTemp(dir, "pyep-normal-test-*")
			require.NoError(t, err)
			defer os.Remove(f.Name())
			require.NoError(t, f.Truncate(int64(R)*(ControlBytes+numBytes)))
			require.NoError(t, f.Close())

			start := time.Now()
			outs := make([]string, R)
			errs := make([]error, R)
			var wg sync.WaitGroup
			for r := 0; r < R; r++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					cmd := exec.Command(os.Args[0], "-test.run=^TestMultiProcessChild$", "-test.count=1", "-test.v")
					cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d:%d:%d:%s", childEnv, r, R, numBytes, f.Name()))
					out, err := cmd.CombinedOutput()
					outs[r], errs[r] = string(out), err
				}()
			}
			wg.Wait()
			for r := 0; r < R; r++ {
				if !assert.NoError(t, errs[r], "rank %d", r) {
					t.Logf("rank %d output:\n%s", r, outs[r])
				}
			}
			t.Logf("%d processes: %v", R, time.Since(start))
			if os.Getenv("PYEP_NORMAL_SHOW_CHILD") != "" { // per-round timings of rank 0

				t.Log(outs[0])
			}
		})
	}
}

func TestMultiProcessChild(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("only run as a child of TestMultiProcess")
	}
	parts := strings.SplitN(spec, ":", 4)
	require.Len(t, parts, 4)
	me, _ := strconv.Atoi(parts[0])
	R, _ := strconv.Atoi(parts[1])
	numBytes, _ := strconv.ParseInt(parts[2], 10, 64)
	f, err := os.OpenFile(parts[3], os.O_RDWR, 0)
	require.NoError(t, err)
	mem, err := syscall.Mmap(int(f.Fd()), 0, R*int(ControlBytes+numBytes), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	require.NoError(t, err)
	defer syscall.Munmap(mem)
	f.Close()

	ctls := make([]unsafe.Pointer, R)
	bufs := make([]unsafe.Pointer, R)
	for r := 0; r < R; r++ {
		base := r * int(ControlBytes+numBytes)
		ctls[r] = unsafe.Pointer(&mem[base])
		bufs[r] = unsafe.Pointer(&mem[base+ControlBytes])
	}
	d := &Domain{Rank: me, NumRanks: R, Buffers: bufs, Controls: ctls, NumBytes: numBytes, Timeout: 60 * time.Second}
	s := &sim{R: R, numBytes: numBytes, only: me, doms: make([]*Domain, R)}
	s.doms[me] = d

	for i, rd := range multiRounds(R) {
		t0, c0 := time.Now(), s.inCalls
		checkRound(t, s, &rd.sc, rd.cc, uint64(1000+i))
		require.False(t, t.Failed(), "round %s", rd.sc.name)
		t.Logf("rank %d: round %q: %v, %v of it in calls", me, rd.sc.name, time.Since(t0), s.inCalls-c0)
	}
	// The last rank skips a barrier; the others time out naming it. It waits
	// until they have given up before its next call.
	short := *d
	short.Timeout = 300 * time.Millisecond
	if me == R-1 {
		for decisionOutcome(d.ctl(0, ctlDecision).Load()) != outAborted {
			time.Sleep(10 * time.Millisecond)
		}
	} else {
		err := Barrier(&short, "skipped")
		require.Error(t, err)
		assert.True(t, errors.Is(err, ErrTimeout), "%v", err)
		assert.Contains(t, err.Error(), fmt.Sprintf("rank %d", R-1))
	}
	require.NoError(t, Barrier(d, "after"))
	rd := multiRounds(R)[0]
	checkRound(t, s, &rd.sc, rd.cc, 2000)
}
