//go:build !cgo

package cuda

import "errors"

type nvmlProbe struct{}

// NVLinkP2P implements NVLinkProbe: without cgo there is no NVML.
func (nvmlProbe) NVLinkP2P(a, b string) (bool, string, error) {
	return false, "", errors.New("pyep: cannot load NVML to check the NVLink topology: this build of pyep has no cgo")
}
