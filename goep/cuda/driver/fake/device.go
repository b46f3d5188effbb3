package fake

import (
	"fmt"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// Devices and contexts.

// DriverVersion reports CUDA 13.0.
func (d *Driver) DriverVersion() (int, error) {
	unlock, err := d.lock("DriverVersion", false)
	defer unlock()
	return 13000, err
}

// DeviceCount is Config.Devices.
func (d *Driver) DeviceCount() (int, error) {
	unlock, err := d.lock("DeviceCount", false)
	defer unlock()
	return d.cfg.Devices, err
}

// DeviceGet returns device ordinal.
func (d *Driver) DeviceGet(ordinal int) (driver.Device, error) {
	unlock, err := d.lock("DeviceGet", false)
	defer unlock()
	dev := driver.NewDevice(d, ordinal)
	if err == nil {
		err = d.device(dev)
	}
	return dev, err
}

// DeviceGetAttribute answers from Config; attributes it does not model read as 0.
func (d *Driver) DeviceGetAttribute(dev driver.Device, attr driver.DeviceAttribute) (int, error) {
	unlock, err := d.lock("DeviceGetAttribute", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return 0, err
	}
	switch attr {
	case driver.AttrMultiprocessorCount:
		return d.cfg.SMs, nil
	case driver.AttrComputeCapabilityMajor:
		return d.cfg.Major, nil
	case driver.AttrComputeCapabilityMinor:
		return d.cfg.Minor, nil
	case driver.AttrMaxThreadsPerBlock:
		return 1024, nil
	case driver.AttrMaxSharedMemoryPerBlockOptin:
		return 232448, nil
	case driver.AttrCanMapHostMemory, driver.AttrUnifiedAddressing:
		return 1, nil
	case driver.AttrPCIBusID:
		return pciBus(dev.Ordinal()), nil
	case driver.AttrVirtualMemoryManagement, driver.AttrHandleTypePosixFD:
		return b2i(d.vmm()), nil
	case driver.AttrHandleTypeFabric:
		return b2i(d.vmm() && d.cfg.Fabric), nil
	}
	return 0, nil
}

// Devices of one World sit on distinct buses, the same for every process.
func pciBus(ordinal int) int { return 0x18 + 0x10*ordinal }

// DeviceGetName is Config.Name.
func (d *Driver) DeviceGetName(dev driver.Device) (string, error) {
	unlock, err := d.lock("DeviceGetName", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	return d.cfg.Name, err
}

// DeviceGetPCIBusID is "0000:BB:00.0", BB depending on the ordinal only.
func (d *Driver) DeviceGetPCIBusID(dev driver.Device) (string, error) {
	unlock, err := d.lock("DeviceGetPCIBusID", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("0000:%02X:00.0", pciBus(dev.Ordinal())), nil
}

// DeviceTotalMem is Config.MemBytes.
func (d *Driver) DeviceTotalMem(dev driver.Device) (int, error) {
	unlock, err := d.lock("DeviceTotalMem", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	return d.cfg.MemBytes, err
}

// DeviceCanAccessPeer is true between distinct devices, as on an NVLink host.
func (d *Driver) DeviceCanAccessPeer(dev, peer driver.Device) (bool, error) {
	unlock, err := d.lock("DeviceCanAccessPeer", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err == nil {
		err = d.device(peer)
	}
	return err == nil && dev.Ordinal() != peer.Ordinal(), err
}

// DevicePrimaryCtxRetain counts references per device.
func (d *Driver) DevicePrimaryCtxRetain(dev driver.Device) (driver.Context, error) {
	unlock, err := d.lock("DevicePrimaryCtxRetain", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return driver.Context{}, err
	}
	d.retained[dev.Ordinal()]++
	return driver.NewContext(d, uintptr(0xc000+dev.Ordinal()), dev), nil
}

// DevicePrimaryCtxRelease fails when nothing is retained, where a real driver would let the
// context go.
func (d *Driver) DevicePrimaryCtxRelease(dev driver.Device) error {
	unlock, err := d.lock("DevicePrimaryCtxRelease", false)
	defer unlock()
	if err == nil {
		err = d.device(dev)
	}
	if err != nil {
		return err
	}
	if d.retained[dev.Ordinal()] == 0 {
		return fmt.Errorf("pyep: fake: primary context of device %d released more often than retained: %w", dev.Ordinal(), driver.ErrorInvalidContext)
	}
	d.retained[dev.Ordinal()]--
	return nil
}

// CtxSetCurrent makes ctx current for the whole process (see the package doc).
func (d *Driver) CtxSetCurrent(ctx driver.Context) error {
	unlock, err := d.lock("CtxSetCurrent", false)
	defer unlock()
	if err != nil {
		return err
	}
	if ctx.Raw() != 0 && d.retained[ctx.Device().Ordinal()] == 0 {
		return fmt.Errorf("pyep: fake: context %#x is not retained: %w", ctx.Raw(), driver.ErrorInvalidContext)
	}
	d.current = ctx
	return nil
}

// CtxGetCurrent returns the current context.
func (d *Driver) CtxGetCurrent() (driver.Context, error) {
	unlock, err := d.lock("CtxGetCurrent", false)
	defer unlock()
	return d.current, err
}

// CtxSynchronize has nothing to wait for.
func (d *Driver) CtxSynchronize() error {
	unlock, err := d.lock("CtxSynchronize", true)
	defer unlock()
	if err == nil {
		d.order.syncAll()
	}
	return err
}

// CtxGetStreamPriorityRange is Hopper's (0, -5).
func (d *Driver) CtxGetStreamPriorityRange() (least, greatest int, err error) {
	unlock, err := d.lock("CtxGetStreamPriorityRange", true)
	defer unlock()
	return 0, -5, err
}

// MemGetInfo is the current device's free and total memory.
func (d *Driver) MemGetInfo() (free, total int, err error) {
	unlock, err := d.lock("MemGetInfo", true)
	defer unlock()
	if err != nil {
		return 0, 0, err
	}
	return d.cfg.MemBytes - d.used[d.current.Device().Ordinal()], d.cfg.MemBytes, nil
}
