package pyep

import (
	"fmt"

	"github.com/pyep/pyep/goep/cuda"
)

// BufferCommStream is the raw CUstream of the buffer's communication stream (cuda backend),
// for torch.cuda.ExternalStream.
func BufferCommStream(id int64) (stream uintptr, err error) {
	defer guard("BufferCommStream", &err)
	b, err := lookup(id)
	if err != nil {
		return 0, err
	}
	be, ok := b.Backend().(*cuda.Backend)
	if !ok {
		return 0, fmt.Errorf("the %s backend has no CUDA stream: get_comm_stream() needs the cuda backend (an NCCL group on GPUs)", b.Backend().Name())
	}
	return be.CommStream().Raw(), nil
}
