package cuda

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/env"
)

// use_fabric: NVLink-domain buffers made with cuMemCreate and shared through cuMem handles
// instead of CUDA IPC. A fabric handle is plain bytes that any process of the NVLink fabric
// imports, but exporting one needs an IMEX channel, which single-node hosts rarely configure;
// a POSIX file descriptor works on any Linux host and crosses processes over a Unix socket
// (fdshare_linux.go).

// MemHandleEnv forces the handle kind of use_fabric buffers: auto (the default), fabric or fd.
const MemHandleEnv = env.MemHandle

type handleMode int

const (
	modeAuto handleMode = iota
	modeFabric
	modeFD
)

// memHandleMode reads MemHandleEnv now, so that a change made before a Buffer's creation
// counts.
func memHandleMode() (handleMode, error) {
	switch v := strings.ToLower(strings.TrimSpace(env.Get(MemHandleEnv))); v {
	case "", "auto":
		return modeAuto, nil
	case "fabric":
		return modeFabric, nil
	case "fd":
		return modeFD, nil
	default:
		return 0, fmt.Errorf("pyep: cuda: %s=%q: expected auto, fabric or fd", MemHandleEnv, v)
	}
}

const fabricNeeds = "fabric handles need a GPU and driver that support them and an IMEX channel " +
	"(/dev/nvidia-caps-imex-channels, set up by NVIDIA's IMEX service); within one node, " +
	"use_fabric=False (CUDA IPC) or " + MemHandleEnv + "=fd works"

// fallbackLog is where AllocateFabric says, once per process, why it shares through file
// descriptors rather than fabric handles.
var (
	fallbackLog  io.Writer = os.Stderr
	fallbackOnce sync.Once
)

// useFD records why fabric handles are out on this backend and says so once per process.
func (b *Backend) useFD(why error) {
	b.fabricMu.Lock()
	if b.fabricErr == nil {
		b.fabricErr = why
	}
	b.fabricMu.Unlock()
	fallbackOnce.Do(func() {
		fmt.Fprintf(fallbackLog, "pyep: use_fabric: no fabric handles on this host (%v); sharing NVLink buffers through "+
			"POSIX file descriptors instead (within one node; fabric handles need an IMEX channel; %s=fd skips this attempt)\n", why, MemHandleEnv)
	})
}

// sharedKinds are the kinds to try for a use_fabric allocation in mode, in order.
func (b *Backend) sharedKinds(mode handleMode) ([]memKind, error) {
	vmm, err := b.dev.Attribute(driver.AttrVirtualMemoryManagement)
	if err != nil {
		return nil, err
	}
	if vmm == 0 {
		return nil, fmt.Errorf("pyep: cuda: use_fabric: device %d has no virtual memory management "+
			"(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0), which cuMem handles need: use use_fabric=False", b.dev.Ordinal())
	}
	fabric, err := b.dev.Attribute(driver.AttrHandleTypeFabric)
	if err != nil {
		return nil, err
	}
	fd, err := b.dev.Attribute(driver.AttrHandleTypePosixFD)
	if err != nil {
		return nil, err
	}
	noFD := fmt.Errorf("pyep: cuda: device %d cannot export POSIX file descriptors "+
		"(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0)", b.dev.Ordinal())
	noFabric := fmt.Errorf("device %d does not support fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0)", b.dev.Ordinal())
	switch mode {
	case modeFabric:
		if fabric == 0 {
			return nil, fmt.Errorf("pyep: cuda: %s=fabric: %w; %s", MemHandleEnv, noFabric, fabricNeeds)
		}
		return []memKind{kindFabric}, nil
	case modeFD:
		if fd == 0 {
			return nil, fmt.Errorf("%w: %s=fd cannot work here", noFD, MemHandleEnv)
		}
		return []memKind{kindFD}, nil
	}
	b.fabricMu.Lock()
	failed := b.fabricErr != nil
	b.fabricMu.Unlock()
	var kinds []memKind
	if fabric != 0 && !failed {
		kinds = append(kinds, kindFabric)
	}
	if fd != 0 {
		if fabric == 0 {
			b.useFD(noFabric)
		}
		kinds = append(kinds, kindFD)
	}
	if len(kinds) == 0 {
		return nil, fmt.Errorf("%w, and fabric handles failed or are unsupported: use use_fabric=False", noFD)
	}
	return kinds, nil
}

// allocateShared makes a use_fabric region: a fabric handle's if it can, else a descriptor's
// (mode allowing). The context must be current.
func (b *Backend) allocateShared(size int64, mode handleMode) (*localRegion, error) {
	kinds, err := b.sharedKinds(mode)
	if err != nil {
		return nil, err
	}
	for i, kind := range kinds {
		l, err := b.allocateVMM(size, kind)
		switch {
		case err == nil:
			return l, nil
		case kind == kindFabric && mode == modeFabric:
			return nil, fmt.Errorf("pyep: cuda: %s=fabric: device %d: %w; %s", MemHandleEnv, b.dev.Ordinal(), err, fabricNeeds)
		case kind == kindFabric && i+1 < len(kinds) && !errors.Is(err, driver.ErrorOutOfMemory):
			b.useFD(err)
		default:
			return nil, err
		}
	}
	return nil, errors.New("pyep: cuda: use_fabric: no handle kind to try") // unreachable: the last kind returns
}

// allocateVMM makes a region of kind kindFD or kindFabric: cuMemCreate memory on this device,
// exported, mapped here, zeroed, with its header; a descriptor is served until Close.
func (b *Backend) allocateVMM(size int64, kind memKind) (_ *localRegion, err error) {
	prop := driver.MemAllocationProp{Location: b.dev, HandleTypes: driver.MemHandlePosixFD}
	if kind == kindFabric {
		prop.HandleTypes = driver.MemHandleFabric
	}
	gran, err := b.drv.MemGetAllocationGranularity(prop, driver.GranularityMinimum)
	if err != nil {
		return nil, err
	}
	if gran <= 0 {
		gran = 1
	}
	total := (int(allocationBytes(size)) + gran - 1) / gran * gran
	l := &localRegion{region: region{b: b, size: size}, kind: kind, mapped: total, fd: -1, self: -1}
	l.mem.size = total
	defer func() {
		if err != nil {
			_ = l.unshare()
			_ = b.releaseVMM(&l.mem)
		}
	}()
	if l.mem.handle, err = b.drv.MemCreate(total, prop); err != nil {
		return nil, err
	}
	l.mem.held = true
	var fabric driver.FabricHandle
	if kind == kindFabric {
		fabric, err = b.drv.MemExportToFabric(l.mem.handle)
	} else {
		l.fd, err = b.drv.MemExportToFD(l.mem.handle)
	}
	if err != nil {
		return nil, err
	}
	if err = b.mapVMM(&l.mem); err != nil {
		return nil, err
	}
	l.base = l.mem.base
	if err = b.initRegion(l); err != nil {
		return nil, err
	}
	t := b.tokenOf(l)
	if kind == kindFabric {
		t.Fabric = fabric
	} else {
		t.Socket = fdSocketName(l.nonce)
		if l.srv, err = serveFD(t.Socket, l.fd, l.nonce); err != nil {
			return nil, err
		}
	}
	l.tok = t.encode()
	return l, nil
}

// vmem is cuMem memory as this process holds it: a handle (made or imported), the address
// range reserved for it and the mapping there, each undone by releaseVMM.
type vmem struct {
	handle                 driver.MemHandle
	size                   int
	base                   driver.DevicePtr
	held, reserved, mapped bool
}

// mapVMM maps v's whole handle at a fresh range, readable and writable by this GPU.
func (b *Backend) mapVMM(v *vmem) error {
	p, err := b.drv.MemAddressReserve(v.size, 0)
	if err != nil {
		return err
	}
	v.base, v.reserved = p, true
	if err := b.drv.MemMap(p, v.size, v.handle); err != nil {
		return err
	}
	v.mapped = true
	return b.drv.MemSetAccess(p, v.size, b.dev, driver.MemAccessReadWrite)
}

// releaseVMM unmaps, frees the range and releases the handle, as far as they were made; the
// context must be current. The memory itself goes once no process holds it.
func (b *Backend) releaseVMM(v *vmem) error {
	var errs []error
	if v.mapped {
		errs = append(errs, b.drv.MemUnmap(v.base, v.size))
		v.mapped = false
	}
	if v.reserved {
		errs = append(errs, b.drv.MemAddressFree(v.base, v.size))
		v.reserved = false
	}
	if v.held {
		errs = append(errs, b.drv.MemRelease(v.handle))
		v.held = false
	}
	return errors.Join(errs...)
}

// importVMM imports t's handle (from fd, which it closes, for kindFD) and maps it here; on
// error nothing is left.
func (b *Backend) importVMM(v *vmem, t token, fd int) (err error) {
	v.size = int(t.Mapped)
	if t.Kind == kindFD {
		v.handle, err = b.drv.MemImportFromFD(fd)
		// The imported handle holds the memory: this copy of the descriptor is not needed.
		if cerr := closeFD(fd); err == nil && cerr != nil {
			_ = b.drv.MemRelease(v.handle)
			err = fmt.Errorf("closing the received descriptor: %w", cerr)
		}
	} else {
		v.handle, err = b.drv.MemImportFromFabric(t.Fabric)
	}
	if err != nil {
		return err
	}
	v.held = true
	if err = b.mapVMM(v); err != nil {
		_ = b.releaseVMM(v)
	}
	return err
}
