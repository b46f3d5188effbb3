//go:build cgo

package cuda

import (
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

var nvmlInit struct {
	once sync.Once
	err  error
}

type nvmlProbe struct{}

// NVLinkP2P implements NVLinkProbe. NVML is initialised once per process and kept.
func (nvmlProbe) NVLinkP2P(a, b string) (bool, string, error) {
	nvmlInit.once.Do(func() {
		if r := nvml.Init(); r != nvml.SUCCESS {
			nvmlInit.err = fmt.Errorf("pyep: NVML (libnvidia-ml.so.1, which comes with the NVIDIA driver) is needed to check the NVLink topology: nvmlInit: %v", r)
		}
	})
	if nvmlInit.err != nil {
		return false, "", nvmlInit.err
	}
	da, r := nvml.DeviceGetHandleByPciBusId(a)
	if r != nvml.SUCCESS {
		return false, "", fmt.Errorf("pyep: nvmlDeviceGetHandleByPciBusId(%s): %v", a, r)
	}
	db, r := nvml.DeviceGetHandleByPciBusId(b)
	if r != nvml.SUCCESS {
		return false, "", fmt.Errorf("pyep: nvmlDeviceGetHandleByPciBusId(%s): %v", b, r)
	}
	s, r := da.GetP2PStatus(db, nvml.P2P_CAPS_INDEX_NVLINK)
	if r != nvml.SUCCESS {
		return false, "", fmt.Errorf("pyep: nvmlDeviceGetP2PStatus(%s, %s, NVLINK): %v", a, b, r)
	}
	return s == nvml.P2P_STATUS_OK, p2pStatusName(int32(s)), nil
}
