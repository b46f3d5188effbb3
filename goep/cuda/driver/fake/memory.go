package fake

import (
	"fmt"
	"unsafe"

	"github.com/pyep/pyep/goep/cuda/driver"
)

// Device and mapped host memory.

func (d *Driver) alloc(bytes int, host bool) (*allocation, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("pyep: fake: allocating %d bytes: %w", bytes, driver.ErrorInvalidValue)
	}
	dev := d.current.Device().Ordinal()
	if !host {
		if d.used[dev]+bytes > d.cfg.MemBytes {
			return nil, fmt.Errorf("pyep: fake: allocating %d bytes with %d of %d in use: %w", bytes, d.used[dev], d.cfg.MemBytes, driver.ErrorOutOfMemory)
		}
		d.used[dev] += bytes
	}
	// 256-byte alignment, like cudaMalloc's (kernels rely on it for vector loads).
	var buf []byte
	if d.cfg.Guard {
		var err error
		if buf, err = guarded(bytes); err != nil {
			return nil, fmt.Errorf("pyep: fake: allocating %d bytes: %v: %w", bytes, err, driver.ErrorOutOfMemory)
		}
	} else {
		raw := make([]byte, bytes+256)
		off := int(-uintptr(unsafe.Pointer(&raw[0])) & 255)
		buf = raw[off : off+bytes : off+bytes]
	}
	d.w.nextID++
	a := &allocation{id: d.w.nextID, buf: buf, base: driver.DevicePtr(uintptr(unsafe.Pointer(&buf[0]))), owner: d, device: dev, host: host}
	d.w.allocs[a.id] = a
	d.mapped[a.base] = a
	return a, nil
}

// own returns d's own allocation at base p (not an IPC mapping), of the given kind.
func (d *Driver) own(op string, p driver.DevicePtr, host bool) (*allocation, error) {
	a, ok := d.mapped[p]
	if !ok || a.owner != d || a.host != host {
		return nil, fmt.Errorf("pyep: fake %s: %#x is not the start of an allocation of this process: %w", op, uint64(p), driver.ErrorInvalidValue)
	}
	return a, nil
}

func (d *Driver) release(a *allocation) {
	delete(d.mapped, a.base)
	a.freed = true
	if a.opened == 0 && a.owner.cfg.Guard {
		unguard(a.buf)
	}
	if !a.host {
		d.used[a.device] -= len(a.buf)
	}
	if a.opened == 0 {
		delete(d.w.allocs, a.id)
	}
}

// MemAlloc allocates zeroed, 256-byte aligned memory (real memory is not zeroed: do not rely
// on it).
func (d *Driver) MemAlloc(bytes int) (driver.DevicePtr, error) {
	unlock, err := d.lock("MemAlloc", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.alloc(bytes, false)
	if err != nil {
		return 0, err
	}
	return a.base, nil
}

// MemFree frees an allocation; peers that opened it keep their mapping until they close it.
func (d *Driver) MemFree(p driver.DevicePtr) error {
	unlock, err := d.lock("MemFree", true)
	defer unlock()
	if err != nil {
		return err
	}
	a, err := d.own("MemFree", p, false)
	if err != nil {
		return err
	}
	d.release(a)
	return nil
}

// MemsetD8 fills memory at once.
func (d *Driver) MemsetD8(p driver.DevicePtr, value byte, bytes int) error {
	unlock, err := d.lock("MemsetD8", true)
	defer unlock()
	if err != nil {
		return err
	}
	return d.memset(p, value, bytes)
}

func (d *Driver) memset(p driver.DevicePtr, value byte, bytes int) error {
	b, err := d.bytes(p, bytes)
	if err != nil {
		return err
	}
	for i := range b {
		b[i] = value
	}
	return nil
}

// MemsetD8Async fills memory at once.
func (d *Driver) MemsetD8Async(p driver.DevicePtr, value byte, bytes int, s driver.Stream) error {
	unlock, err := d.lock("MemsetD8Async", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err != nil {
		return err
	}
	return d.memset(p, value, bytes)
}

// MemcpyHtoD copies at once.
func (d *Driver) MemcpyHtoD(dst driver.DevicePtr, src []byte) error {
	unlock, err := d.lock("MemcpyHtoD", true)
	defer unlock()
	if err != nil || len(src) == 0 {
		return err
	}
	b, err := d.bytes(dst, len(src))
	if err != nil {
		return err
	}
	copy(b, src)
	return nil
}

// MemcpyDtoH copies at once.
func (d *Driver) MemcpyDtoH(dst []byte, src driver.DevicePtr) error {
	unlock, err := d.lock("MemcpyDtoH", true)
	defer unlock()
	if err != nil || len(dst) == 0 {
		return err
	}
	b, err := d.bytes(src, len(dst))
	if err != nil {
		return err
	}
	copy(dst, b)
	return nil
}

// MemcpyAsync copies at once (overlapping ranges as memmove).
func (d *Driver) MemcpyAsync(dst, src driver.DevicePtr, bytes int, s driver.Stream) error {
	unlock, err := d.lock("MemcpyAsync", true)
	defer unlock()
	if err == nil {
		err = d.stream(s)
	}
	if err != nil || bytes == 0 {
		return err
	}
	from, err := d.bytes(src, bytes)
	if err != nil {
		return err
	}
	to, err := d.bytes(dst, bytes)
	if err != nil {
		return err
	}
	copy(to, from)
	return nil
}

// MemHostAlloc allocates Go memory that stands for pinned host memory.
func (d *Driver) MemHostAlloc(bytes int, flags driver.HostAllocFlags) (unsafe.Pointer, error) {
	unlock, err := d.lock("MemHostAlloc", true)
	defer unlock()
	if err != nil {
		return nil, err
	}
	a, err := d.alloc(bytes, true)
	if err != nil {
		return nil, err
	}
	return unsafe.Pointer(&a.buf[0]), nil
}

// MemHostGetDevicePointer returns the same address, as with unified addressing.
func (d *Driver) MemHostGetDevicePointer(p unsafe.Pointer) (driver.DevicePtr, error) {
	unlock, err := d.lock("MemHostGetDevicePointer", true)
	defer unlock()
	if err != nil {
		return 0, err
	}
	a, err := d.own("MemHostGetDevicePointer", driver.DevicePtr(uintptr(p)), true)
	if err != nil {
		return 0, err
	}
	return a.base, nil
}

// MemFreeHost frees MemHostAlloc's memory.
func (d *Driver) MemFreeHost(p unsafe.Pointer) error {
	unlock, err := d.lock("MemFreeHost", true)
	defer unlock()
	if err != nil {
		return err
	}
	a, err := d.own("MemFreeHost", driver.DevicePtr(uintptr(p)), true)
	if err != nil {
		return err
	}
	d.release(a)
	return nil
}

// PointerGetAttribute answers for any address inside memory of d.
func (d *Driver) PointerGetAttribute(attr driver.PointerAttribute, p driver.DevicePtr) (uint64, error) {
	unlock, err := d.lock("PointerGetAttribute", false)
	defer unlock()
	if err != nil {
		return 0, err
	}
	for base, a := range d.mapped {
		if p < base || p >= base+driver.DevicePtr(len(a.buf)) {
			continue
		}
		switch attr {
		case driver.PointerAttrMemoryType:
			if a.host {
				return uint64(driver.MemoryTypeHost), nil
			}
			return uint64(driver.MemoryTypeDevice), nil
		case driver.PointerAttrDeviceOrdinal:
			return uint64(a.device), nil
		case driver.PointerAttrDevicePointer:
			return uint64(p), nil
		case driver.PointerAttrRangeStartAddr:
			return uint64(base), nil
		case driver.PointerAttrRangeSize:
			return uint64(len(a.buf)), nil
		case driver.PointerAttrContext:
			return uint64(0xc000 + a.device), nil
		}
		return 0, fmt.Errorf("pyep: fake: pointer attribute %d: %w", attr, driver.ErrorNotSupported)
	}
	if base, m := d.vmapAt(p); m != nil {
		switch attr {
		case driver.PointerAttrMemoryType:
			return uint64(driver.MemoryTypeDevice), nil
		case driver.PointerAttrDeviceOrdinal:
			return uint64(m.phys.device), nil
		case driver.PointerAttrDevicePointer:
			return uint64(p), nil
		case driver.PointerAttrRangeStartAddr:
			return uint64(base), nil
		case driver.PointerAttrRangeSize:
			return uint64(m.size), nil
		}
		return 0, fmt.Errorf("pyep: fake: pointer attribute %d of mapped memory: %w", attr, driver.ErrorNotSupported)
	}
	return 0, fmt.Errorf("pyep: fake: %#x is not memory of this process: %w", uint64(p), driver.ErrorInvalidValue)
}
