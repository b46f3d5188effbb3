package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// memKind is how an NVLink-domain allocation is shared with the peers' processes.
type memKind uint8

const (
	// kindIPC: cuMemAlloc, shared through cuIpcGetMemHandle (the default).
	kindIPC memKind = 1
	// kindFD: cuMemCreate, shared through a POSIX file descriptor that the owner serves over
	// an abstract Unix-domain socket (use_fabric without fabric handles).
	kindFD memKind = 2
	// kindFabric: cuMemCreate, shared through a fabric handle (use_fabric).
	kindFabric memKind = 3
	// kindDevice: no memory, only the GPU it names (BusID, Host): a buffer without an NVLink
	// region tells its peers which GPU it runs on (DeviceToken), which nothing can map.
	kindDevice memKind = 4
)

func (k memKind) String() string {
	switch k {
	case kindIPC:
		return "CUDA IPC"
	case kindFD:
		return "POSIX file descriptor"
	case kindFabric:
		return "fabric"
	case kindDevice:
		return "device only"
	}
	return fmt.Sprintf("memory kind %d", uint8(k))
}

// token is what a peer needs to map a rank's NVLink-domain region (Backend.Allocate's
// LocalRegion.Token): how the memory is shared (Kind) and its handle (the CUDA IPC handle, the
// fabric handle, or the name of the socket that serves the file descriptor), and what lets the
// peer check, before and after mapping, that the region is what it expects: the GPU's PCI bus
// id (for the NVLink check), the host and process that made it, the data size and a random
// nonce that the region's header repeats (a handle of a freed allocation whose memory now holds
// something else is caught by it).
type token struct {
	Kind    memKind
	Nonce   uint64
	Size    int64 // data bytes, as Allocate's size
	Mapped  int64 // bytes of the allocation (and of a peer's mapping): at least allocationBytes(Size)
	IPC     driver.IpcMemHandle
	Fabric  driver.FabricHandle
	BusID   string // cuDeviceGetPCIBusId of the owner's GPU, e.g. "0000:1B:00.0"
	Host    string // the owner's host (its boot id)
	Process string // the owner's process (its pid, or BackendOptions.Process)
	Socket  string // kindFD: the abstract socket that serves the descriptor, e.g. "@pyep-123-9f..."
}

var tokenMagic = [6]byte{'P', 'Y', 'E', 'P', 'C', 'U'}

const (
	tokenVersion = 2
	// magic, version, kind, nonce, size, mapped size, handle (IPC or fabric, else zeros);
	// then four length-prefixed strings.
	tokenFixed = 6 + 1 + 1 + 8 + 8 + 8 + 64
)

func (t token) encode() []byte {
	var b bytes.Buffer
	b.Write(tokenMagic[:])
	b.WriteByte(tokenVersion)
	b.WriteByte(byte(t.Kind))
	_ = binary.Write(&b, binary.LittleEndian, t.Nonce)
	_ = binary.Write(&b, binary.LittleEndian, uint64(t.Size))
	_ = binary.Write(&b, binary.LittleEndian, uint64(t.Mapped))
	switch t.Kind {
	case kindIPC:
		b.Write(t.IPC[:])
	case kindFabric:
		b.Write(t.Fabric[:])
	default:
		b.Write(make([]byte, 64))
	}
	for _, s := range []string{t.BusID, t.Host, t.Process, t.Socket} {
		if len(s) > 255 {
			s = s[:255]
		}
		b.WriteByte(byte(len(s)))
		b.WriteString(s)
	}
	return b.Bytes()
}

func decodeToken(raw []byte) (token, error) {
	if len(raw) < 7 || !bytes.Equal(raw[:6], tokenMagic[:]) {
		return token{}, fmt.Errorf("not a token of pyep's cuda backend (%d bytes)", len(raw))
	}
	if raw[6] != tokenVersion {
		return token{}, fmt.Errorf("cuda token version %d: expected %d (ranks run different pyep versions)", raw[6], tokenVersion)
	}
	if len(raw) < tokenFixed {
		return token{}, errors.New("truncated token of pyep's cuda backend")
	}
	le := binary.LittleEndian
	t := token{Kind: memKind(raw[7]), Nonce: le.Uint64(raw[8:]), Size: int64(le.Uint64(raw[16:])), Mapped: int64(le.Uint64(raw[24:]))}
	switch t.Kind {
	case kindIPC:
		copy(t.IPC[:], raw[32:96])
	case kindFabric:
		copy(t.Fabric[:], raw[32:96])
	}
	rest := raw[tokenFixed:]
	var fields [4]string
	for i := range fields {
		if len(rest) < 1 || len(rest) < 1+int(rest[0]) {
			return token{}, errors.New("truncated token of pyep's cuda backend")
		}
		fields[i], rest = string(rest[1:1+int(rest[0])]), rest[1+int(rest[0]):]
	}
	if len(rest) != 0 {
		return token{}, errors.New("token of pyep's cuda backend with trailing bytes")
	}
	t.BusID, t.Host, t.Process, t.Socket = fields[0], fields[1], fields[2], fields[3]
	switch {
	case t.Kind != kindIPC && t.Kind != kindFD && t.Kind != kindFabric && t.Kind != kindDevice:
		return token{}, fmt.Errorf("token of pyep's cuda backend with an unknown memory kind %d", raw[7])
	case t.Size < 0 || t.Size > math.MaxInt64-allocationBytes(0) || t.Mapped < allocationBytes(t.Size) || t.Mapped != int64(int(t.Mapped)):
		return token{}, fmt.Errorf("token of pyep's cuda backend with %d data bytes in a %d-byte allocation", t.Size, t.Mapped)
	case (t.Kind == kindFD) != (t.Socket != ""):
		return token{}, fmt.Errorf("token of pyep's cuda backend: a %s handle with socket name %q", t.Kind, t.Socket)
	}
	return t, nil
}

// hostID names this boot of this machine: two processes with the same one can share device
// memory through CUDA IPC (or file descriptors).
func hostID() string {
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		if id := strings.TrimSpace(string(b)); id != "" {
			return id
		}
	}
	name, _ := os.Hostname()
	return "host:" + name
}

// DeviceToken implements goep.DeviceTokens: a token of this GPU and host that maps nothing
// (kindDevice), which a buffer without an NVLink region puts in its handle, so that the
// low-latency engine learns which ranks share its GPU (RanksOnDevice) across nodes too.
func (b *Backend) DeviceToken() []byte {
	return token{Kind: kindDevice, Mapped: allocationBytes(0), BusID: b.busID, Host: b.host, Process: b.process}.encode()
}

// RanksOnDevice counts the tokens (every rank's, from Sync's handles) of buffers on this GPU:
// its bus id on this host (a node's GPU at the same PCI address on another machine is another).
func (b *Backend) RanksOnDevice(tokens [][]byte) int {
	n := 0
	for _, raw := range tokens {
		if t, err := decodeToken(raw); err == nil && t.BusID == b.busID && t.Host == b.host {
			n++
		}
	}
	return n
}
