package cuda

import (
	"fmt"
	"strings"
)

// NVLinkProbe tells whether two GPUs of this host, named by PCI bus id (as
// Device.PCIBusID spells it), reach each other over NVLink. NVML returns the real one; tests
// pass their own through BackendOptions.NVLink.
type NVLinkProbe interface {
	// NVLinkP2P reports ok when a and b are P2P-connected over NVLink (directly or through
	// NVSwitch); otherwise status says why, in NVML's words (e.g. "NOT_SUPPORTED"). err is for
	// a probe that could not answer at all.
	NVLinkP2P(a, b string) (ok bool, status string, err error)
}

// NVML returns the probe over NVML (libnvidia-ml.so.1, loaded on first use through go-nvml):
// nvmlDeviceGetHandleByPciBusId for both GPUs, then nvmlDeviceGetP2PStatus with
// NVML_P2P_CAPS_INDEX_NVLINK. NVML numbers GPUs by bus id, regardless of
// CUDA_VISIBLE_DEVICES, so a rank can probe GPUs its process does not see.
func NVML() NVLinkProbe { return nvmlProbe{} }

// peerGPU is one rank of an NVLink domain as CheckPeers sees it.
type peerGPU struct {
	who   string // "rank 3", "this rank"
	busID string
}

func (p peerGPU) String() string { return fmt.Sprintf("%s (GPU %s)", p.who, p.busID) }

// checkNVLink probes every pair of distinct gpus and names the first pair that is not
// connected; the message says what to do instead. Ranks on the same GPU need no link. cache memoises answers by bus-id pair (may be nil).
func checkNVLink(probe NVLinkProbe, gpus []peerGPU, cache map[[2]string]string) error {
	var bad []string
	for i := range gpus {
		for j := i + 1; j < len(gpus); j++ {
			a, b := gpus[i], gpus[j]
			if strings.EqualFold(a.busID, b.busID) {
				// Ranks sharing a GPU reach each other's memory through CUDA IPC inside the device:
				// no link to probe.
				continue
			}
			status, err := probeCached(probe, a.busID, b.busID, cache)
			if err != nil {
				return fmt.Errorf("checking NVLink between %s and %s: %w", a, b, err)
			}
			if status != "" {
				bad = append(bad, fmt.Sprintf("%s and %s are not connected by NVLink (P2P status: %s)", a, b, status))
			}
		}
	}
	switch len(bad) {
	case 0:
		return nil
	case 1:
	default:
		bad[0] += fmt.Sprintf(" (and %d more pairs)", len(bad)-1)
	}
	return fmt.Errorf("%s; pyep's cuda backend needs NVLink between every pair of GPUs in a node — the cpu backend (gloo group) remains", bad[0])
}

// probeCached returns "" for connected GPUs, else the status.
func probeCached(probe NVLinkProbe, a, b string, cache map[[2]string]string) (string, error) {
	key := [2]string{strings.ToLower(a), strings.ToLower(b)}
	if key[1] < key[0] {
		key[0], key[1] = key[1], key[0]
	}
	if s, ok := cache[key]; ok {
		return s, nil
	}
	ok, status, err := probe.NVLinkP2P(a, b)
	if err != nil {
		return "", err
	}
	if ok {
		status = ""
	} else if status == "" {
		status = "unknown"
	}
	if cache != nil {
		cache[key] = status
	}
	return status, nil
}

// p2pStatusName names an nvmlGpuP2PStatus_t as nvml.h does, without its prefix.
func p2pStatusName(s int32) string {
	switch s {
	case 0:
		return "OK"
	case 1:
		return "CHIPSET_NOT_SUPPORTED"
	case 2:
		return "GPU_NOT_SUPPORTED"
	case 3:
		return "IOH_TOPOLOGY_NOT_SUPPORTED"
	case 4:
		return "DISABLED_BY_REGKEY"
	case 5:
		return "NOT_SUPPORTED"
	case 6:
		return "UNKNOWN"
	}
	return fmt.Sprintf("status %d", s)
}
