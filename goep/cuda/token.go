package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
)

// token is what a peer needs to map a rank's NVLink-domain region (Backend.Allocate's
// LocalRegion.Token): the CUDA IPC handle, and what lets the peer check, before and after
// mapping, that the region is what it expects: the GPU's PCI bus id (for the NVLink check),
// the host and process that made it, the data size and a random nonce that the region's
// header repeats (a handle of a freed allocation whose memory now holds something else is
// caught by it).
type token struct {
	Nonce   uint64
	Size    int64 // data bytes, as Allocate's size
	IPC     IpcMemHandle
	BusID   string // cuDeviceGetPCIBusId of the owner's GPU, e.g. "0000:1B:00.0"
	Host    string // the owner's host (its boot id)
	Process string // the owner's process (its pid, or BackendOptions.Process)
}

var tokenMagic = [6]byte{'P', 'Y', 'E', 'P', 'C', 'U'}

const (
	tokenVersion = 1
	// magic, version, reserved, nonce, size, IPC handle; then three length-prefixed strings.
	tokenFixed = 6 + 1 + 1 + 8 + 8 + 64
)

func (t token) encode() []byte {
	var b bytes.Buffer
	b.Write(tokenMagic[:])
	b.WriteByte(tokenVersion)
	b.WriteByte(0)
	_ = binary.Write(&b, binary.LittleEndian, t.Nonce)
	_ = binary.Write(&b, binary.LittleEndian, uint64(t.Size))
	b.Write(t.IPC[:])
	for _, s := range []string{t.BusID, t.Host, t.Process} {
		if len(s) > 255 {
			s = s[:255]
		}
		b.WriteByte(byte(len(s)))
		b.WriteString(s)
	}
	return b.Bytes()
}

func decodeToken(raw []byte) (token, error) {
	if len(raw) < tokenFixed || !bytes.Equal(raw[:6], tokenMagic[:]) {
		return token{}, fmt.Errorf("not a token of pyep's cuda backend (%d bytes)", len(raw))
	}
	if raw[6] != tokenVersion {
		return token{}, fmt.Errorf("cuda token version %d: expected %d (ranks run different pyep versions)", raw[6], tokenVersion)
	}
	le := binary.LittleEndian
	t := token{Nonce: le.Uint64(raw[8:]), Size: int64(le.Uint64(raw[16:]))}
	copy(t.IPC[:], raw[24:88])
	rest := raw[tokenFixed:]
	var fields [3]string
	for i := range fields {
		if len(rest) < 1 || len(rest) < 1+int(rest[0]) {
			return token{}, errors.New("truncated token of pyep's cuda backend")
		}
		fields[i], rest = string(rest[1:1+int(rest[0])]), rest[1+int(rest[0]):]
	}
	if len(rest) != 0 {
		return token{}, errors.New("token of pyep's cuda backend with trailing bytes")
	}
	t.BusID, t.Host, t.Process = fields[0], fields[1], fields[2]
	return t, nil
}

// hostID names this boot of this machine: two processes with the same one can share device
// memory through CUDA IPC.
func hostID() string {
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		if id := strings.TrimSpace(string(b)); id != "" {
			return id
		}
	}
	name, _ := os.Hostname()
	return "host:" + name
}
