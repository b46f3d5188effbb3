// Package pyep is what gopy binds into Python (python/pyep/_gopy): plain values, hex strings
// for bytes and uintptr addresses across, and every export turns a panic into an error, since a
// Go panic would otherwise abort the interpreter.
//
// Buffers are named by integer ids (goep/api keeps them): a stale or destroyed id is an error,
// never a dangling Go handle. pyep imports no backend: goep/api makes them by name. Errors that are the caller's fault carry the prefix "ValueError: " (or "TypeError: ")
// so that Python raises that exception for them; "NotAvailableError: " marks what pyep cannot run
// in this setting yet (pyep.NotAvailableError).
package pyep

import (
	"encoding/hex"
	"fmt"
	"runtime/debug"
	"strconv"
	"strings"
	"unsafe"

	"github.com/pyep/pyep/goep"
	"github.com/pyep/pyep/goep/api"
	"github.com/pyep/pyep/goep/dlpack"
)

// Version is the pyep version the extension was built as.
func Version() string { return goep.Version }

// guard recovers a panic of an export into its error, and marks argument errors with the
// Python exception they become.
func guard(op string, err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("pyep internal error in %s: %v\n%s", op, r, debug.Stack())
	}
	switch {
	case *err == nil:
	case goep.IsType(*err):
		*err = fmt.Errorf("TypeError: %w", *err)
	case goep.IsArgument(*err):
		*err = fmt.Errorf("ValueError: %w", *err)
	case goep.IsNotAvailable(*err):
		*err = fmt.Errorf("NotAvailableError: %w", *err)
	}
}

// lookup finds buffer id (goep/api keeps the ids).
func lookup(id int64) (*goep.Buffer, error) { return api.Buffer(id) }

// NewBuffer allocates a Buffer on the named backend ("cpu", or "cuda:N" for device ordinal N,
// torch.cuda.current_device()) and returns its id; PYEP_RANKS_PER_NODE is read now
// (goep.NewBuffer), so Python may set it just before.
func NewBuffer(backend string, rank, numRanks int, numNVLBytes, numRDMABytes int64,
	lowLatencyMode, explicitlyDestroy, enableShrink, useFabric, allowNVLinkForLowLatency bool) (id int64, err error) {
	defer guard("NewBuffer", &err)
	return api.NewBuffer(backend, goep.Params{
		Rank: rank, NumRanks: numRanks, NumNVLBytes: numNVLBytes, NumRDMABytes: numRDMABytes,
		LowLatencyMode: lowLatencyMode, ExplicitlyDestroy: explicitlyDestroy,
		EnableShrink: enableShrink, UseFabric: useFabric, NoNVLinkForLowLatency: !allowNVLinkForLowLatency,
	})
}

// BufferInfo is "device_id rank num_ranks rdma_rank num_rdma_ranks nvl_rank num_nvl_ranks
// ranks_per_node" (the last is PYEP_RANKS_PER_NODE's node size, 0 when unset), read once by Python.
func BufferInfo(id int64) (info string, err error) {
	defer guard("BufferInfo", &err)
	b, err := lookup(id)
	if err != nil {
		return "", err
	}
	t := b.Topology()
	return fmt.Sprint(b.LocalDeviceID(), t.Rank, t.NumRanks, t.RDMARank, t.NumRDMARanks, t.NVLRank, t.NumNVLRanks, t.RanksPerNode), nil
}

// BufferLocalIPCHandle is the hex of this rank's IPC handle ("" without an NVLink buffer).
func BufferLocalIPCHandle(id int64) (handle string, err error) {
	defer guard("BufferLocalIPCHandle", &err)
	b, err := lookup(id)
	if err != nil {
		return "", err
	}
	h, err := b.LocalIPCHandle()
	return hex.EncodeToString(h), err
}

// BufferLocalNVSHMEMUniqueID is the hex of a fresh unique id for the root rank to share.
func BufferLocalNVSHMEMUniqueID(id int64) (uid string, err error) {
	defer guard("BufferLocalNVSHMEMUniqueID", &err)
	b, err := lookup(id)
	if err != nil {
		return "", err
	}
	u, err := b.LocalNVSHMEMUniqueID()
	return hex.EncodeToString(u), err
}

// BufferSync syncs with the peers. deviceIDs are space-separated integers; handles are
// space-separated hex strings with "-" for a rank that gave none; rootUniqueID is hex or "".
func BufferSync(id int64, deviceIDs, handles, rootUniqueID string) (err error) {
	defer guard("BufferSync", &err)
	b, err := lookup(id)
	if err != nil {
		return err
	}
	var devs []int
	for _, f := range strings.Fields(deviceIDs) {
		d, err := strconv.Atoi(f)
		if err != nil {
			return goep.Argf("device_ids: %q is not an integer", f)
		}
		devs = append(devs, d)
	}
	var hs [][]byte
	for i, f := range strings.Fields(handles) {
		if f == "-" {
			hs = append(hs, nil)
			continue
		}
		h, err := hex.DecodeString(f)
		if err != nil {
			return goep.Argf("ipc_handles[%d]: not a handle from get_local_ipc_handle()", i)
		}
		hs = append(hs, h)
	}
	root, err := hex.DecodeString(rootUniqueID)
	if err != nil {
		return goep.Argf("root_unique_id: not an id from get_local_nvshmem_unique_id()")
	}
	return b.Sync(devs, hs, root)
}

// BufferIsAvailable reports whether the buffer is synced and not destroyed.
func BufferIsAvailable(id int64) (ok bool, err error) {
	defer guard("BufferIsAvailable", &err)
	b, err := lookup(id)
	if err != nil {
		return false, nil
	}
	return b.IsAvailable(), nil
}

// BufferDestroy releases the buffer and forgets its id; destroying an unknown id is a no-op,
// so that destroy stays idempotent.
func BufferDestroy(id int64) (err error) {
	defer guard("BufferDestroy", &err)
	return api.Destroy(id)
}

// BufferView returns a DLManagedTensor address viewing NVLink peer nvlRank's data region (or
// the local RDMA region) from byte offset on, as elements of the DLPack type (code, bits).
func BufferView(id int64, nvlRank int, rdma bool, code, bits int, offset int64) (addr uintptr, err error) {
	defer guard("BufferView", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	if nvlRank < 0 {
		nvlRank = b.Topology().NVLRank
	}
	data, size, err := b.PeerData(nvlRank, rdma)
	if err != nil {
		return 0, err
	}
	dt := dlpack.DType{Code: uint8(code), Bits: uint8(bits)}
	if bits <= 0 || bits%8 != 0 {
		return 0, goep.Argf("dtype: %d-bit elements are not addressable bytes", bits)
	}
	if offset < 0 || offset > size || offset%int64(dt.Size()) != 0 {
		return 0, goep.Argf("offset = %d: expected a multiple of the element size %d within the %d-byte buffer", offset, dt.Size(), size)
	}
	devType := dlpack.CPU
	if dev := b.LocalDeviceID(); dev >= 0 {
		devType = dlpack.CUDA
	}
	return dlpack.NewView(unsafe.Add(data, offset), devType, max(0, b.LocalDeviceID()), dt, (size-offset)/int64(dt.Size()))
}

// ConfigCheck validates a Config and returns its fields as the runtime uses them
// (space-separated; the RDMA receive ring rounded up to whole send chunks).
func ConfigCheck(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv int) (fields string, err error) {
	defer guard("ConfigCheck", &err)
	c, err := goep.NewConfig(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return "", err
	}
	return configFields(c), nil
}

func configFields(c goep.Config) string {
	return fmt.Sprint(c.NumSMs, c.NumMaxNVLChunkedSendTokens, c.NumMaxNVLChunkedRecvTokens,
		c.NumMaxRDMAChunkedSendTokens, c.NumMaxRDMAChunkedRecvTokens)
}

// ConfigSizeHint is the NVLink (rdma=false) or RDMA buffer size a config needs.
func ConfigSizeHint(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv, hiddenBytes, numRanks int, rdma bool) (n int64, err error) {
	defer guard("ConfigSizeHint", &err)
	c, err := goep.NewConfig(numSMs, nvlSend, nvlRecv, rdmaSend, rdmaRecv)
	if err != nil {
		return 0, err
	}
	if rdma {
		return c.RDMABufferSizeHint(hiddenBytes, numRanks)
	}
	return c.NVLBufferSizeHint(hiddenBytes, numRanks)
}

// DefaultConfig is the recommended "dispatch" or "combine" config for numRanks ranks, as
// ConfigCheck's fields.
func DefaultConfig(kind string, numRanks, numSMs int) (fields string, err error) {
	defer guard("DefaultConfig", &err)
	var c goep.Config
	switch kind {
	case "dispatch":
		c, err = goep.DefaultDispatchConfig(numRanks, numSMs)
	case "combine":
		c, err = goep.DefaultCombineConfig(numRanks, numSMs)
	default:
		return "", goep.Argf("kind %q: expected dispatch or combine", kind)
	}
	if err != nil {
		return "", err
	}
	return configFields(c), nil
}

// DebugPanic panics on purpose, so that tests can check that a Go panic reaches Python as an
// exception and the process survives.
func DebugPanic(message string) (err error) {
	defer guard("DebugPanic", &err)
	panic(message)
}
