package goep

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

// Handle is what a peer needs to map a rank's NVLink-domain buffer: who made it, for which
// group shape and size, and the backend's own token (a shared-memory name, a CUDA IPC handle).
// It travels between ranks as bytes (torch.distributed's all_gather_object).
type Handle struct {
	Backend  string
	Rank     int
	NumRanks int
	Size     int64
	Token    []byte
	// The low-latency (RDMA) region's size and token, where the backend shares it on one node
	// (0 and empty otherwise).
	RDMASize  int64
	RDMAToken []byte
}

var handleMagic = [4]byte{'P', 'Y', 'E', 'P'}

const (
	handleVersion = 2
	// handleHeader: magic, version, backend length, rank, num_ranks, size, token length; the
	// backend name and the token follow, then the RDMA size and token length, and the RDMA token.
	handleHeader  = 4 + 1 + 1 + 4 + 4 + 8 + 2
	rdmaHeader    = 8 + 2
	maxTokenBytes = 1024
)

// Encode serialises the handle; Decode reverses it.
func (h Handle) Encode() []byte {
	var b bytes.Buffer
	b.Write(handleMagic[:])
	b.WriteByte(handleVersion)
	b.WriteByte(byte(len(h.Backend)))
	_ = binary.Write(&b, binary.LittleEndian, uint32(h.Rank))
	_ = binary.Write(&b, binary.LittleEndian, uint32(h.NumRanks))
	_ = binary.Write(&b, binary.LittleEndian, uint64(h.Size))
	_ = binary.Write(&b, binary.LittleEndian, uint16(len(h.Token)))
	b.WriteString(h.Backend)
	b.Write(h.Token)
	_ = binary.Write(&b, binary.LittleEndian, uint64(h.RDMASize))
	_ = binary.Write(&b, binary.LittleEndian, uint16(len(h.RDMAToken)))
	b.Write(h.RDMAToken)
	return b.Bytes()
}

// DecodeHandle parses bytes made by Encode and rejects anything else.
func DecodeHandle(raw []byte) (Handle, error) {
	if len(raw) < handleHeader || !bytes.Equal(raw[:4], handleMagic[:]) {
		return Handle{}, fmt.Errorf("not a pyep buffer handle (%d bytes)", len(raw))
	}
	if raw[4] != handleVersion {
		return Handle{}, fmt.Errorf("handle version %d: expected %d (ranks run different pyep versions)", raw[4], handleVersion)
	}
	backendLen := int(raw[5])
	le := binary.LittleEndian
	h := Handle{
		Rank:     int(le.Uint32(raw[6:])),
		NumRanks: int(le.Uint32(raw[10:])),
		Size:     int64(le.Uint64(raw[14:])),
	}
	tokenLen := int(le.Uint16(raw[22:]))
	end := handleHeader + backendLen + tokenLen
	if tokenLen > maxTokenBytes || len(raw) < end+rdmaHeader {
		return Handle{}, fmt.Errorf("truncated or padded pyep buffer handle (%d bytes)", len(raw))
	}
	h.Backend = string(raw[handleHeader : handleHeader+backendLen])
	h.Token = bytes.Clone(raw[handleHeader+backendLen : end])
	h.RDMASize = int64(le.Uint64(raw[end:]))
	rdmaLen := int(le.Uint16(raw[end+8:]))
	if rdmaLen > maxTokenBytes || len(raw) != end+rdmaHeader+rdmaLen {
		return Handle{}, fmt.Errorf("truncated or padded pyep buffer handle (%d bytes)", len(raw))
	}
	if rdmaLen > 0 {
		h.RDMAToken = bytes.Clone(raw[end+rdmaHeader:])
	}
	return h, nil
}
