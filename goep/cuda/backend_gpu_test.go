package cuda_test

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/cuda"
	"github.com/pyep/pyep/goep/cuda/driver"
)

// Tests of the Backend over the real driver: they skip, saying why, without libcuda or GPUs.

func realDriver(t *testing.T, gpus int) driver.Driver {
	t.Helper()
	drv, err := driver.Open()
	if err != nil {
		t.Skipf("no CUDA driver, so no real-GPU backend test: %v", err)
	}
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	if n < gpus {
		t.Skipf("%d GPUs wanted, the driver sees %d", gpus, n)
	}
	return drv
}

// readBack copies device memory to the host in the backend's context.
func readBack(t *testing.T, be *cuda.Backend, p driver.DevicePtr, n int) []byte {
	t.Helper()
	exit, err := be.Enter()
	defer exit()
	require.NoError(t, err)
	out := make([]byte, n)
	require.NoError(t, be.Driver().MemcpyDtoH(out, p))
	return out
}

func fill(t *testing.T, be *cuda.Backend, p driver.DevicePtr, v byte, n int) {
	t.Helper()
	exit, err := be.Enter()
	defer exit()
	require.NoError(t, err)
	require.NoError(t, be.Driver().MemsetD8(p, v, n))
	require.NoError(t, be.Driver().CtxSynchronize())
}

func TestGPUBackend(t *testing.T) {
	drv := realDriver(t, 1)
	be, err := cuda.NewBackend(drv, 0, cuda.BackendOptions{Timeout: 20 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	t.Logf("device 0 at %s", be.PCIBusID())

	const size = 1 << 20
	l, err := be.Allocate(size, 1)
	require.NoError(t, err)
	ctrl := cuda.PtrOf(l.Control())
	assert.Equal(t, make([]byte, goep.ControlBytes+size), readBack(t, be, ctrl, goep.ControlBytes+size), "zeroed")
	kind, err := drv.PointerGetAttribute(driver.PointerAttrMemoryType, cuda.PtrOf(l.Data()))
	require.NoError(t, err)
	assert.EqualValues(t, driver.MemoryTypeDevice, kind)
	require.NoError(t, l.Close())

	rdma, err := be.AllocateRDMA(1 << 16)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 1<<16), readBack(t, be, cuda.PtrOf(rdma.Data()), 1<<16))
	require.NoError(t, rdma.Close())

	// The stream order both ways, as a call queues it.
	require.NoError(t, be.StreamWait(be.CommStream(), be.WrapStream(0)))
	require.NoError(t, be.StreamWait(be.WrapStream(0), be.CommStream()))
}

// TestGPUNVLinkProbe asks NVML about every pair of visible GPUs.
func TestGPUNVLinkProbe(t *testing.T) {
	drv := realDriver(t, 2)
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	buses := make([]string, n)
	for i := range buses {
		d, err := drv.DeviceGet(i)
		require.NoError(t, err)
		buses[i], err = d.PCIBusID()
		require.NoError(t, err)
	}
	for i := range buses {
		for j := i + 1; j < n; j++ {
			ok, status, err := cuda.NVML().NVLinkP2P(buses[i], buses[j])
			require.NoError(t, err)
			t.Logf("%s - %s: NVLink P2P %v (%s)", buses[i], buses[j], ok, status)
		}
	}
}

// TestGPUBackendTwoProcesses: this process is rank 0 on device 0, a child (this test binary
// again, TestGPUBackendChild) rank 1 on device 1. They exchange tokens, check the topology,
// open each other's buffers, write through them, and destroy with the release handshake:
// with CUDA IPC (Allocate), and with use_fabric (AllocateFabric) through POSIX file
// descriptors and through fabric handles (skipped where the host has none).
func TestGPUBackendTwoProcesses(t *testing.T) {
	for _, mode := range []string{"ipc", "fd", "fabric"} {
		t.Run(mode, func(t *testing.T) { twoProcesses(t, mode) })
	}
}

// allocateIn allocates as mode says: "ipc" through Allocate, else through AllocateFabric
// with PYEP_MEM_HANDLE=mode (set by the caller).
func allocateIn(be *cuda.Backend, mode string, size int64) (goep.LocalRegion, error) {
	if mode == "ipc" {
		return be.Allocate(size, 1)
	}
	return be.AllocateFabric(size, 1)
}

func twoProcesses(t *testing.T, mode string) {
	drv := realDriver(t, 2)
	if mode != "ipc" {
		t.Setenv(cuda.MemHandleEnv, mode)
	}
	be, err := cuda.NewBackend(drv, 0, cuda.BackendOptions{Timeout: 30 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	const size = 1 << 20
	l, err := allocateIn(be, mode, size)
	if mode == "fabric" && err != nil {
		assert.Contains(t, err.Error(), "IMEX channel", "the error says what fabric handles need")
		t.Skipf("no fabric handles on this host: %v", err)
	}
	require.NoError(t, err)
	assert.Equal(t, mode, cuda.TokenKind(l.Token()))
	fill(t, be, cuda.PtrOf(l.Data()), 0xa5, size/2)

	cmd := exec.Command(os.Args[0], "-test.run=^TestGPUBackendChild$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "PYEP_TEST_BACKEND_TOKEN="+hex.EncodeToString(l.Token()), "PYEP_TEST_BACKEND_MODE="+mode)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(stdout)
	var log strings.Builder
	next := func(prefix string) string {
		for lines.Scan() {
			log.WriteString(lines.Text() + "\n")
			if rest, ok := strings.CutPrefix(lines.Text(), prefix); ok {
				return rest
			}
		}
		require.FailNow(t, "the child ended early", "%s\n%s", log.String(), stderr.String())
		return ""
	}
	tok1, err := hex.DecodeString(next("TOKEN "))
	require.NoError(t, err)
	assert.Equal(t, mode, cuda.TokenKind(tok1))
	tokens := [][]byte{l.Token(), tok1}
	require.NoError(t, be.CheckPeers(0, []int{0, 1}, tokens))
	r1, err := be.Open(tok1, size)
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{0x3c}, 64), readBack(t, be, cuda.PtrOf(r1.Data()), 64), "the child's data, over NVLink")
	fill(t, be, cuda.PtrOf(r1.Data()).Add(size-64), 0x77, 64)
	next("DONE")
	assert.Equal(t, bytes.Repeat([]byte{0x5a}, size/2), readBack(t, be, cuda.PtrOf(l.Data()).Add(size/2), size/2), "the child's writes")

	require.NoError(t, r1.Close())
	start := time.Now()
	require.NoError(t, l.Close(), "the child released this buffer")
	t.Logf("destroy waited %v for the child's release", time.Since(start))
	_, _ = io.Copy(&log, stdout)
	require.NoError(t, cmd.Wait(), "%s\n%s", log.String(), stderr.String())
	assert.Contains(t, log.String(), "--- PASS: TestGPUBackendChild")
	assert.Zero(t, be.Deferred())
}

func TestGPUBackendChild(t *testing.T) {
	hs := os.Getenv("PYEP_TEST_BACKEND_TOKEN")
	if hs == "" {
		t.Skip("run by TestGPUBackendTwoProcesses in a child process")
	}
	mode := os.Getenv("PYEP_TEST_BACKEND_MODE")
	tok0, err := hex.DecodeString(hs)
	require.NoError(t, err)
	drv := realDriver(t, 2)
	be, err := cuda.NewBackend(drv, 1, cuda.BackendOptions{Timeout: 30 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	const size = 1 << 20
	l, err := allocateIn(be, mode, size)
	require.NoError(t, err)
	fill(t, be, cuda.PtrOf(l.Data()), 0x3c, 64)
	fmt.Printf("TOKEN %s\n", hex.EncodeToString(l.Token()))
	tokens := [][]byte{tok0, l.Token()}
	require.NoError(t, be.CheckPeers(1, []int{0, 1}, tokens))
	r0, err := be.Open(tok0, size)
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{0xa5}, size/2), readBack(t, be, cuda.PtrOf(r0.Data()), size/2))
	fill(t, be, cuda.PtrOf(r0.Data()).Add(size/2), 0x5a, size/2)
	fmt.Println("DONE")
	require.NoError(t, r0.Close())
	require.NoError(t, l.Close(), "the parent released this buffer")
	assert.Zero(t, be.Deferred())
}

// TestGPUAllocateFabric: use_fabric memory on one GPU, of every kind the host offers: zeroed
// device memory, freed again by Close.
func TestGPUAllocateFabric(t *testing.T) {
	drv := realDriver(t, 1)
	be, err := cuda.NewBackend(drv, 0, cuda.BackendOptions{Timeout: 20 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	for _, attr := range []driver.DeviceAttribute{driver.AttrVirtualMemoryManagement, driver.AttrHandleTypePosixFD, driver.AttrHandleTypeFabric} {
		v, err := be.Device().Attribute(attr)
		require.NoError(t, err)
		t.Logf("device attribute %d: %d", attr, v)
	}
	for _, mode := range []string{"auto", "fd", "fabric"} {
		t.Run(mode, func(t *testing.T) {
			t.Setenv(cuda.MemHandleEnv, mode)
			const size = 3 << 20 // not a multiple of the granularity, with the header
			free0, _, err := func() (int, int, error) {
				exit, err := be.Enter()
				defer exit()
				require.NoError(t, err)
				return drv.MemGetInfo()
			}()
			require.NoError(t, err)
			l, err := be.AllocateFabric(size, 1)
			if mode == "fabric" && err != nil {
				assert.Contains(t, err.Error(), "IMEX channel")
				t.Skipf("no fabric handles on this host: %v", err)
			}
			require.NoError(t, err)
			t.Logf("%s: shared through %s", mode, cuda.TokenKind(l.Token()))
			if mode != "auto" {
				assert.Equal(t, mode, cuda.TokenKind(l.Token()))
			}
			ctrl := cuda.PtrOf(l.Control())
			assert.Equal(t, make([]byte, goep.ControlBytes+size), readBack(t, be, ctrl, goep.ControlBytes+size), "zeroed")
			kind, err := drv.PointerGetAttribute(driver.PointerAttrMemoryType, cuda.PtrOf(l.Data()))
			require.NoError(t, err)
			assert.EqualValues(t, driver.MemoryTypeDevice, kind)
			fill(t, be, cuda.PtrOf(l.Data()).Add(size-1), 1, 1)
			require.NoError(t, l.Close())
			free1, _, err := func() (int, int, error) {
				exit, err := be.Enter()
				defer exit()
				require.NoError(t, err)
				return drv.MemGetInfo()
			}()
			require.NoError(t, err)
			assert.InDelta(t, free0, free1, 64<<20, "Close gives the memory back")
		})
	}
}
