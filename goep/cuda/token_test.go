package cuda

import (
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func sampleTokens() map[string]token {
	base := token{Nonce: 0x1122334455667788, Size: 1 << 20, Mapped: allocationBytes(1 << 20), BusID: "0000:1B:00.0", Host: "boot-id", Process: "4242"}
	ipc, fd, fabric := base, base, base
	ipc.Kind = kindIPC
	for i := range ipc.IPC {
		ipc.IPC[i] = byte(i + 1)
	}
	fd.Kind, fd.Mapped, fd.Socket = kindFD, 4<<20, "@pyep-4242-1122334455667788"
	fabric.Kind, fabric.Mapped = kindFabric, 4<<20
	for i := range fabric.Fabric {
		fabric.Fabric[i] = byte(200 - i)
	}
	return map[string]token{"ipc": ipc, "fd": fd, "fabric": fabric}
}

func TestTokenRoundTrip(t *testing.T) {
	for name, tok := range sampleTokens() {
		t.Run(name, func(t *testing.T) {
			raw := tok.encode()
			got, err := decodeToken(raw)
			require.NoError(t, err)
			assert.Equal(t, tok, got)
			assert.Equal(t, tok.Nonce, binary.LittleEndian.Uint64(raw[8:]), "the nonce stays at offset 8")
			for n := range len(raw) {
				_, err := decodeToken(raw[:n])
				assert.Error(t, err, "a token cut to %d bytes", n)
			}
			_, err = decodeToken(append(raw, 0))
			assert.ErrorContains(t, err, "trailing bytes")
		})
	}
}

func TestTokenDecodeRefusesBadTokens(t *testing.T) {
	good := sampleTokens()
	mutate := func(name string, f func(*token)) []byte {
		tok := good[name]
		f(&tok)
		return tok.encode()
	}
	withByte := func(i int, v byte) []byte {
		raw := good["fd"].encode()
		raw[i] = v
		return raw
	}
	for _, c := range []struct {
		name string
		raw  []byte
		want string
	}{
		{"garbage", []byte("garbage"), "not a token of pyep's cuda backend"},
		{"empty", nil, "not a token of pyep's cuda backend (0 bytes)"},
		{"version 1", withByte(6, 1), "cuda token version 1: expected 2 (ranks run different pyep versions)"},
		{"unknown kind", withByte(7, 9), "unknown memory kind 9"},
		{"kind 0", withByte(7, 0), "unknown memory kind 0"},
		{"mapped below the allocation", mutate("fabric", func(t *token) { t.Mapped = 4096 }), "1048576 data bytes in a 4096-byte allocation"},
		{"negative size", mutate("ipc", func(t *token) { t.Size = -1 }), "-1 data bytes"},
		{"huge size", mutate("ipc", func(t *token) { t.Size, t.Mapped = 1<<63-1, 1<<63-1 }), "data bytes"},
		{"fd without a socket", mutate("fd", func(t *token) { t.Socket = "" }), `a POSIX file descriptor handle with socket name ""`},
		{"fabric with a socket", mutate("fabric", func(t *token) { t.Socket = "@x" }), `a fabric handle with socket name "@x"`},
		{"ipc with a socket", mutate("ipc", func(t *token) { t.Socket = "@x" }), `a CUDA IPC handle with socket name "@x"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := decodeToken(c.raw)
			assert.ErrorContains(t, err, c.want)
		})
	}
}

func TestMemHandleMode(t *testing.T) {
	for _, c := range []struct {
		env  string
		want handleMode
		err  string
	}{
		{"", modeAuto, ""}, {"auto", modeAuto, ""}, {" Fabric ", modeFabric, ""}, {"fd", modeFD, ""},
		{"ipc", 0, `PYEP_MEM_HANDLE="ipc": expected auto, fabric or fd`},
	} {
		t.Run(c.env, func(t *testing.T) {
			t.Setenv(MemHandleEnv, c.env)
			got, err := memHandleMode()
			if c.err != "" {
				assert.ErrorContains(t, err, c.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.want, got)
		})
	}
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// sameFDs waits briefly for the descriptor count to come back to want: the server closes its
// end of a connection just after the client has read from it.
func sameFDs(t *testing.T, want int, msg string) {
	t.Helper()
	assert.Eventually(t, func() bool {
		ents, err := os.ReadDir("/proc/self/fd")
		return err == nil && len(ents) == want
	}, 2*time.Second, time.Millisecond, msg)
}

// TestFDServer passes a pipe's descriptor between two sockets of this process, over real
// SCM_RIGHTS, and checks what the importer sees and refuses.
func TestFDServer(t *testing.T) {
	var p [2]int
	require.NoError(t, syscall.Pipe2(p[:], syscall.O_CLOEXEC))
	defer syscall.Close(p[0])
	const nonce = 0xfeedface12345678
	name := fdSocketName(nonce)
	assert.Equal(t, fmt.Sprintf("@pyep-%d-feedface12345678", os.Getpid()), name)
	srv, err := serveFD(name, p[1], nonce)
	require.NoError(t, err)
	before := openFDs(t)

	pid := strconv.Itoa(os.Getpid())
	for range 3 { // every connection gets its copy
		fd, err := receiveFD(name, nonce, pid, time.Second)
		require.NoError(t, err)
		_, err = syscall.Write(fd, []byte("hi"))
		require.NoError(t, err, "the received descriptor is the pipe's write end")
		buf := make([]byte, 2)
		_, err = syscall.Read(p[0], buf)
		require.NoError(t, err)
		assert.Equal(t, "hi", string(buf))
		require.NoError(t, syscall.Close(fd))
	}
	sameFDs(t, before, "no descriptor left behind")

	_, err = receiveFD(name, nonce+1, pid, time.Second)
	assert.ErrorContains(t, err, "the socket serves another buffer")
	_, err = receiveFD(name, nonce, "1", time.Second)
	assert.ErrorContains(t, err, fmt.Sprintf("the socket belongs to process %d", os.Getpid()))
	fd, err := receiveFD(name, nonce, "rank1", time.Second)
	require.NoError(t, err, "a process name that is no pid is not checked")
	require.NoError(t, syscall.Close(fd))
	sameFDs(t, before, "refused descriptors are closed")

	require.NoError(t, srv.Close())
	require.NoError(t, srv.Close(), "idempotent")
	_, err = receiveFD(name, nonce, pid, time.Second)
	assert.ErrorContains(t, err, "receiving the buffer's file descriptor from process "+pid+" over "+name)
	assert.ErrorContains(t, err, "the buffer was destroyed or its process exited")
	require.NoError(t, syscall.Close(p[1]), "the server no longer uses it")

	taken, err := serveFD("@pyep-test-taken", p[0], 1)
	require.NoError(t, err)
	_, err = serveFD("@pyep-test-taken", p[0], 1)
	assert.ErrorContains(t, err, "address already in use")
	require.NoError(t, taken.Close())
}

// The ranks that share this GPU are the tokens of its bus id on this host: a GPU of another
// node at the same PCI address (identical machines) is not this one.
func TestRanksOnDevice(t *testing.T) {
	b := &Backend{busID: "0000:1B:00.0", host: "boot-a"}
	on := func(bus, host string) []byte {
		return token{Kind: kindIPC, Size: 1 << 20, Mapped: allocationBytes(1 << 20), BusID: bus, Host: host, Process: "1"}.encode()
	}
	tokens := [][]byte{on("0000:1B:00.0", "boot-a"), on("0000:1B:00.0", "boot-a"), on("0000:1B:00.0", "boot-b"),
		on("0000:2C:00.0", "boot-a"), nil, []byte("not a token")}
	assert.Equal(t, 2, b.RanksOnDevice(tokens))
}

// A buffer without an NVLink region hands its peers a device token: it decodes, names this GPU
// and host (RanksOnDevice counts it), and maps nothing (Open refuses it, naming why).
func TestDeviceToken(t *testing.T) {
	b := &Backend{busID: "0000:1B:00.0", host: "boot-a", process: "7"}
	raw := b.DeviceToken()
	tok, err := decodeToken(raw)
	require.NoError(t, err)
	assert.Equal(t, token{Kind: kindDevice, Mapped: allocationBytes(0), BusID: "0000:1B:00.0", Host: "boot-a", Process: "7"}, tok)
	other := &Backend{busID: "0000:1B:00.0", host: "boot-b", process: "8"}
	assert.Equal(t, 2, b.RanksOnDevice([][]byte{raw, (&Backend{busID: "0000:1B:00.0", host: "boot-a", process: "9"}).DeviceToken(),
		other.DeviceToken()}))
	_, err = b.Open(other.DeviceToken(), 0)
	assert.EqualError(t, err, "the peer's handle names its GPU only: it has no NVLink buffer (num_nvl_bytes = 0 there)")
}
