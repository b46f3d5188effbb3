package cuda_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
)

// Tests of use_fabric (Backend.AllocateFabric) over fake GPUs: the memory is cuMemCreate's,
// shared through fabric handles or through real file descriptors passed over the owner's
// Unix socket.

func newFabricRanks(t *testing.T, n int, cfg fake.Config, timeout time.Duration) []rank {
	t.Helper()
	cfg.World, cfg.Devices = fake.NewWorld(), 8
	ranks := make([]rank, n)
	for r := range ranks {
		d := fake.New(cfg)
		be, err := cuda.NewBackend(d, r, cuda.BackendOptions{Timeout: timeout, NVLink: &links{}, Process: fmt.Sprint("rank", r)})
		require.NoError(t, err)
		ranks[r] = rank{d, be}
	}
	return ranks
}

// openFDs counts this process's descriptors, after the network poller has made its own.
func openFDs(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("unix", fmt.Sprintf("@pyep-test-warm-%d", os.Getpid()))
	require.NoError(t, err)
	require.NoError(t, ln.Close())
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// sameFDs waits briefly for the descriptor count to come back to want: a server closes its
// end of a connection just after the client has read from it.
func sameFDs(t *testing.T, want int, msgAndArgs ...any) {
	t.Helper()
	openFDs(t) // the poller's own first
	var got int
	ok := assert.Eventually(t, func() bool {
		ents, err := os.ReadDir("/proc/self/fd")
		got = len(ents)
		return err == nil && got == want
	}, 2*time.Second, time.Millisecond, msgAndArgs...)
	if !ok {
		t.Logf("%d descriptors open, %d expected", got, want)
	}
}

// fabricDomain is domain with AllocateFabric.
func fabricDomain(t *testing.T, ranks []rank, size int64) ([]goep.LocalRegion, [][]byte) {
	t.Helper()
	return domainWith(t, ranks, size, (*cuda.Backend).AllocateFabric)
}

func TestAllocateFabricKinds(t *testing.T) {
	const n, size = 3, 1 << 12
	for _, c := range []struct {
		name string
		env  string
		cfg  fake.Config
		fail string // a Driver call to fail once, with CUDA_ERROR_NOT_PERMITTED, on every rank
		want string
		log  string // the fallback line, "" for none
	}{
		{name: "auto with fabric", cfg: fake.Config{Fabric: true}, want: "fabric"},
		{name: "auto without fabric support", want: "fd",
			log: "no fabric handles on this host (device 0 does not support fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0))"},
		{name: "auto without an IMEX channel", cfg: fake.Config{Fabric: true, NoIMEX: true}, want: "fd",
			log: "fabric handles without an IMEX channel: CUDA_ERROR_NOT_PERMITTED"},
		{name: "auto with a failing export", cfg: fake.Config{Fabric: true}, fail: "MemExportToFabric", want: "fd",
			log: "MemExportToFabric (injected): CUDA_ERROR_NOT_PERMITTED"},
		{name: "forced fabric", env: "fabric", cfg: fake.Config{Fabric: true}, want: "fabric"},
		{name: "forced fd", env: "fd", cfg: fake.Config{Fabric: true}, want: "fd"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, c.env)
			var log bytes.Buffer
			defer cuda.CaptureFallbackLog(&log)()
			rk := newFabricRanks(t, n, c.cfg, time.Second)
			fds := openFDs(t)
			if c.fail != "" {
				for _, r := range rk {
					r.drv.FailNext(c.fail, driver.ErrorNotPermitted)
				}
			}
			locals, tokens := fabricDomain(t, rk, size)
			for r := range rk {
				assert.Equal(t, c.want, cuda.TokenKind(tokens[r]), "rank %d", r)
				all := mem(t, rk[r].drv, locals[r].Control(), goep.ControlBytes+size)
				assert.Equal(t, make([]byte, len(all)), all, "control and data are zeroed")
				ord, err := rk[r].drv.PointerGetAttribute(driver.PointerAttrDeviceOrdinal, cuda.PtrOf(locals[r].Data()))
				require.NoError(t, err)
				assert.EqualValues(t, r, ord, "on the rank's own GPU")
			}
			if c.log == "" {
				assert.Empty(t, log.String())
			} else {
				t.Log(log.String())
				assert.Contains(t, log.String(), c.log)
				assert.Equal(t, 1, strings.Count(log.String(), "\n"), "one line for the process, whichever rank fell back: %s", log.String())
				assert.Contains(t, log.String(), "sharing NVLink buffers through POSIX file descriptors instead")
			}
			if c.fail != "" {
				for _, r := range rk {
					l, err := r.be.AllocateFabric(size, 1)
					require.NoError(t, err)
					assert.Equal(t, "fd", cuda.TokenKind(l.Token()), "fabric is not tried again on this backend")
					require.NoError(t, l.Close())
				}
			}

			peers := openAll(t, rk, tokens, size)
			for r := range rk {
				for p := range rk {
					if p != r {
						assert.NotEqual(t, locals[p].Data(), peers[r][p].Data(), "mapped at the opener's own address")
					}
				}
			}
			crossWrite(t, rk, locals, peers, size)
			for r := range rk {
				for p := range rk {
					if p != r {
						require.NoError(t, peers[r][p].Close())
					}
				}
			}
			for r := range rk {
				require.NoError(t, locals[r].Close())
				assert.Zero(t, rk[r].be.Deferred())
			}
			sameFDs(t, fds, "every descriptor is closed")
			closeRanks(t, rk)
		})
	}
}

func TestAllocateFabricErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		env  string
		cfg  fake.Config
		want []string
	}{
		{"forced fabric without support", "fabric", fake.Config{}, []string{
			"PYEP_MEM_HANDLE=fabric: device 0 does not support fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0)",
			"an IMEX channel", "use_fabric=False (CUDA IPC) or PYEP_MEM_HANDLE=fd works"}},
		{"forced fabric without an IMEX channel", "fabric", fake.Config{Fabric: true, NoIMEX: true}, []string{
			"PYEP_MEM_HANDLE=fabric: device 0: ", "CUDA_ERROR_NOT_PERMITTED", "an IMEX channel",
			"use_fabric=False (CUDA IPC) or PYEP_MEM_HANDLE=fd works"}},
		{"no virtual memory management", "", fake.Config{NoVMM: true}, []string{
			"device 0 has no virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)", "use_fabric=False"}},
		{"a bad PYEP_MEM_HANDLE", "posix", fake.Config{}, []string{`PYEP_MEM_HANDLE="posix": expected auto, fabric or fd`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, c.env)
			var log bytes.Buffer
			defer cuda.CaptureFallbackLog(&log)()
			rk := newFabricRanks(t, 1, c.cfg, time.Second)
			live, fds := rk[0].drv.Live(), openFDs(t)
			_, err := rk[0].be.AllocateFabric(1024, 1)
			require.Error(t, err)
			for _, w := range c.want {
				assert.Contains(t, err.Error(), w)
			}
			assert.Empty(t, log.String(), "a forced kind falls back to nothing")
			assert.Equal(t, live, rk[0].drv.Live(), "nothing leaks")
			sameFDs(t, fds)
			closeRanks(t, rk)
		})
	}
}

func TestAllocateFabricFailureLeaksNothing(t *testing.T) {
	for _, env := range []string{"fd", "fabric"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, env)
			rk := newFabricRanks(t, 1, fake.Config{Fabric: true}, time.Second)
			live, fds := rk[0].drv.Live(), openFDs(t)
			ops := []string{"MemGetAllocationGranularity", "MemCreate", "MemAddressReserve", "MemMap", "MemSetAccess", "MemsetD8Async", "MemcpyAsync"}
			if env == "fd" {
				ops = append(ops, "MemExportToFD")
			} else {
				ops = append(ops, "MemExportToFabric")
			}
			for _, op := range ops {
				rk[0].drv.FailNext(op, driver.ErrorOutOfMemory)
				_, err := rk[0].be.AllocateFabric(1024, 1)
				assert.ErrorIs(t, err, driver.ErrorOutOfMemory, op)
				assert.Equal(t, live, rk[0].drv.Live(), "failed %s leaks", op)
				sameFDs(t, fds, "failed %s leaks a descriptor", op)
			}
			closeRanks(t, rk)
		})
	}
}

// TestAllocateFabricAutoKeepsOutOfMemory: running out of memory is no reason to leave fabric
// handles; the error is the caller's.
func TestAllocateFabricAutoKeepsOutOfMemory(t *testing.T) {
	var log bytes.Buffer
	defer cuda.CaptureFallbackLog(&log)()
	rk := newFabricRanks(t, 1, fake.Config{Fabric: true}, time.Second)
	rk[0].drv.FailNext("MemCreate", driver.ErrorOutOfMemory)
	_, err := rk[0].be.AllocateFabric(1024, 1)
	assert.ErrorIs(t, err, driver.ErrorOutOfMemory)
	assert.Empty(t, log.String())
	l, err := rk[0].be.AllocateFabric(1024, 1)
	require.NoError(t, err)
	assert.Equal(t, "fabric", cuda.TokenKind(l.Token()))
	require.NoError(t, l.Close())
	closeRanks(t, rk)
}

func TestOpenSharedChecks(t *testing.T) {
	for _, env := range []string{"fd", "fabric"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, env)
			rk := newFabricRanks(t, 2, fake.Config{Fabric: true}, time.Second)
			fds0 := openFDs(t)
			l, err := rk[0].be.AllocateFabric(512, 1)
			require.NoError(t, err)
			live, fds := rk[1].drv.Live(), openFDs(t)

			_, err = rk[0].be.Open(l.Token(), 512)
			assert.ErrorContains(t, err, "made by this process")
			_, err = rk[1].be.Open(l.Token(), 1024)
			assert.ErrorContains(t, err, "the peer's buffer has 512 bytes: expected 1024")

			// A token whose nonce is not the region's.
			tok := l.Token()
			binary.LittleEndian.PutUint64(tok[8:], binary.LittleEndian.Uint64(tok[8:])+1)
			_, err = rk[1].be.Open(tok, 512)
			if env == "fd" {
				assert.ErrorContains(t, err, "the socket serves another buffer")
			} else {
				assert.ErrorContains(t, err, "no longer exists")
			}
			assert.Equal(t, live, rk[1].drv.Live(), "the mapping was undone")

			// A failing mapping step leaves nothing behind.
			for _, op := range []string{"MemAddressReserve", "MemMap", "MemSetAccess", "MemcpyAsync"} {
				rk[1].drv.FailNext(op, driver.ErrorInvalidValue)
				_, err = rk[1].be.Open(l.Token(), 512)
				assert.ErrorIs(t, err, driver.ErrorInvalidValue, op)
				assert.Equal(t, live, rk[1].drv.Live(), "failed %s leaks", op)
				sameFDs(t, fds, "failed %s leaks a descriptor", op)
			}

			// The token of a destroyed buffer.
			stale := l.Token()
			require.NoError(t, l.Close())
			_, err = rk[1].be.Open(stale, 512)
			if env == "fd" {
				assert.ErrorContains(t, err, "receiving the buffer's file descriptor from process rank0 over @pyep-")
				assert.ErrorContains(t, err, "the buffer was destroyed or its process exited")
			} else {
				assert.ErrorIs(t, err, driver.ErrorInvalidValue)
			}
			assert.Equal(t, live, rk[1].drv.Live())
			sameFDs(t, fds0)
			closeRanks(t, rk)
		})
	}
}

// TestFabricDestroyWaitsForPeers: the release handshake and the deferred free hold for cuMem
// memory as for CUDA IPC's; the descriptor is served no longer once the buffer is closed.
func TestFabricDestroyWaitsForPeers(t *testing.T) {
	for _, env := range []string{"fd", "fabric"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, env)
			rk := newFabricRanks(t, 2, fake.Config{Fabric: true}, 50*time.Millisecond)
			fds := openFDs(t)
			locals, tokens := fabricDomain(t, rk, 512)
			peers := openAll(t, rk, tokens, 512)
			require.NoError(t, peers[0][1].Close())
			assert.ErrorContains(t, locals[0].Close(), "rank 1 still maps this rank's buffer after 50ms")
			assert.Equal(t, 1, rk[0].be.Deferred())
			if env == "fd" {
				_, err := rk[1].be.Open(tokens[0], 512)
				assert.ErrorContains(t, err, "the buffer was destroyed", "a closed buffer's descriptor is served no more")
			}

			// Rank 1 still reads and writes rank 0's memory until it releases it.
			mem(t, rk[1].drv, peers[1][0].Data(), 512)[0] = 42
			assert.Equal(t, byte(42), mem(t, rk[0].drv, locals[0].Data(), 1)[0])
			require.NoError(t, peers[1][0].Close())
			require.NoError(t, locals[1].Close())
			// An allocation sweeps; a sweep frees what no peer maps once the device is idle, which it
			// checks for 1 ms only (under load, as in CI's parallel packages, one sweep can miss it).
			assert.Eventually(t, func() bool {
				l, err := rk[0].be.AllocateFabric(512, 1)
				if !assert.NoError(t, err) {
					return true
				}
				assert.NoError(t, l.Close())
				return rk[0].be.Deferred() == 0
			}, 5*time.Second, 10*time.Millisecond, "the released buffer is freed by a sweep")
			sameFDs(t, fds)
			closeRanks(t, rk)
		})
	}
}

// TestBufferUseFabric: goep.Buffer allocates through AllocateFabric when Params.UseFabric is
// set, through Allocate (CUDA IPC) otherwise.
func TestBufferUseFabric(t *testing.T) {
	for _, c := range []struct {
		useFabric bool
		want      string
	}{{false, "ipc"}, {true, "fabric"}} {
		t.Run(c.want, func(t *testing.T) {
			const n, size = 2, 1 << 12
			rk := newFabricRanks(t, n, fake.Config{Fabric: true}, time.Second)
			bufs := make([]*goep.Buffer, n)
			handles := make([][]byte, n)
			for r := range rk {
				b, err := goep.NewBuffer(goep.Params{Rank: r, NumRanks: n, NumNVLBytes: size, UseFabric: c.useFabric}, rk[r].be)
				require.NoError(t, err)
				bufs[r] = b
				handles[r], err = b.LocalIPCHandle()
				require.NoError(t, err)
				h, err := goep.DecodeHandle(handles[r])
				require.NoError(t, err)
				assert.Equal(t, c.want, cuda.TokenKind(h.Token))
			}
			for r := range rk {
				require.NoError(t, bufs[r].Sync([]int{0, 1}, handles, nil))
			}
			for r := range rk {
				p, _, err := bufs[r].PeerData(1-r, false)
				require.NoError(t, err)
				mem(t, rk[r].drv, p, size)[size-1] = byte(r + 1)
			}
			for r := range rk {
				p, _, err := bufs[r].LocalData(false)
				require.NoError(t, err)
				assert.Equal(t, byte(2-r), mem(t, rk[r].drv, p, size)[size-1])
			}
			// Destroy is collective: both ranks at once, as their processes would.
			errs := make(chan error, n)
			for r := range rk {
				go func() { errs <- bufs[r].Destroy() }()
			}
			for range rk {
				require.NoError(t, <-errs)
			}
			closeRanks(t, rk)
		})
	}
}
