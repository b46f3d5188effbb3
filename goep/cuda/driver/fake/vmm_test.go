//go:build linux

package fake_test

import (
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pyep/pyep/goep/cuda/driver"
	"github.com/pyep/pyep/goep/cuda/driver/fake"
)

// mapHere reserves a range in d, maps h there and lets dev read and write it.
func mapHere(t *testing.T, d *fake.Driver, h driver.MemHandle, n int, dev driver.Device) driver.DevicePtr {
	t.Helper()
	p, err := d.MemAddressReserve(n, 0)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(p, n, h))
	require.NoError(t, d.MemSetAccess(p, n, dev, driver.MemAccessReadWrite))
	return p
}

func unmapHere(t *testing.T, d *fake.Driver, p driver.DevicePtr, n int, h driver.MemHandle) {
	t.Helper()
	require.NoError(t, d.MemUnmap(p, n))
	require.NoError(t, d.MemAddressFree(p, n))
	require.NoError(t, d.MemRelease(h))
}

func TestVMMMapAndAccess(t *testing.T) {
	d, ctx := process(t, fake.NewWorld(), 0)
	dev := ctx.Device()
	for _, attr := range []driver.DeviceAttribute{driver.AttrVirtualMemoryManagement, driver.AttrHandleTypePosixFD} {
		v, err := dev.Attribute(attr)
		require.NoError(t, err)
		assert.Equal(t, 1, v, "attribute %d", attr)
	}
	v, err := dev.Attribute(driver.AttrHandleTypeFabric)
	require.NoError(t, err)
	assert.Zero(t, v, "no fabric unless configured")

	prop := driver.MemAllocationProp{Location: dev, HandleTypes: driver.MemHandlePosixFD}
	g, err := d.MemGetAllocationGranularity(prop, driver.GranularityMinimum)
	require.NoError(t, err)
	assert.Equal(t, fake.Granularity, g)
	_, err = d.MemCreate(g+1, prop)
	assert.ErrorIs(t, err, driver.ErrorInvalidValue, "not a multiple of the granularity")
	_, err = d.MemCreate(g, driver.MemAllocationProp{Location: dev, HandleTypes: driver.MemHandleFabric})
	assert.ErrorIs(t, err, driver.ErrorNotSupported)

	h, err := d.MemCreate(2*g, prop)
	require.NoError(t, err)
	free, _, err := d.MemGetInfo()
	require.NoError(t, err)
	assert.Equal(t, 1<<30-2*g, free, "counted as device memory")
	p, err := d.MemAddressReserve(2*g, 0)
	require.NoError(t, err)
	assert.Zero(t, uint64(p)%uint64(g), "aligned to the granularity")
	assert.ErrorIs(t, d.MemMap(p+1, g, h), driver.ErrorInvalidValue, "not at a granule")
	assert.ErrorIs(t, d.MemMap(p, 4*g, h), driver.ErrorInvalidValue, "beyond the reservation")
	require.NoError(t, d.MemMap(p, 2*g, h))
	assert.ErrorIs(t, d.MemMap(p, g, h), driver.ErrorInvalidValue, "overlapping")
	_, err = d.Bytes(p, 16)
	assert.ErrorIs(t, err, driver.ErrorIllegalAddress, "no access before MemSetAccess")
	require.NoError(t, d.MemSetAccess(p, 2*g, dev, driver.MemAccessReadWrite))
	require.NoError(t, d.MemsetD8(p.Add(g), 7, 4))
	b, err := d.Bytes(p.Add(g), 4)
	require.NoError(t, err)
	assert.Equal(t, []byte{7, 7, 7, 7}, b)
	start, err := d.PointerGetAttribute(driver.PointerAttrRangeStartAddr, p.Add(g))
	require.NoError(t, err)
	assert.EqualValues(t, p, start)
	_, err = d.Bytes(p.Add(2*g-2), 4)
	assert.ErrorIs(t, err, driver.ErrorIllegalAddress, "past the mapping")

	assert.ErrorIs(t, d.MemAddressFree(p, 2*g), driver.ErrorInvalidValue, "still mapped")
	require.NoError(t, d.MemRelease(h))
	assert.Equal(t, []byte{7, 7, 7, 7}, b, "the mapping holds the memory after its handle is released")
	require.NoError(t, d.MemUnmap(p, 2*g))
	require.NoError(t, d.MemAddressFree(p, 2*g))
	free, _, err = d.MemGetInfo()
	require.NoError(t, err)
	assert.Equal(t, 1<<30, free)
	assert.Zero(t, d.Live())
}

func TestVMMSharing(t *testing.T) {
	w := fake.NewWorld()
	for _, kind := range []driver.MemHandleType{driver.MemHandlePosixFD, driver.MemHandleFabric} {
		a := fake.New(fake.Config{World: w, Devices: 2, Fabric: true})
		b := fake.New(fake.Config{World: w, Devices: 2, Fabric: true})
		devA, devB := driver.NewDevice(a, 0), driver.NewDevice(b, 1)
		for _, x := range []struct {
			d   *fake.Driver
			dev driver.Device
		}{{a, devA}, {b, devB}} {
			ctx, err := x.dev.PrimaryContext()
			require.NoError(t, err)
			require.NoError(t, ctx.MakeCurrent())
		}
		g := fake.Granularity
		h, err := a.MemCreate(g, driver.MemAllocationProp{Location: devA, HandleTypes: kind})
		require.NoError(t, err)
		pa := mapHere(t, a, h, g, devA)

		var hb driver.MemHandle
		if kind == driver.MemHandlePosixFD {
			_, err = a.MemExportToFabric(h)
			assert.ErrorIs(t, err, driver.ErrorInvalidValue, "not created for fabric handles")
			fd, err := a.MemExportToFD(h)
			require.NoError(t, err)
			hb, err = b.MemImportFromFD(fd)
			require.NoError(t, err)
			require.NoError(t, syscall.Close(fd), "the importer's copy is the caller's")
			f, err := os.CreateTemp("", "pyep-not-device-memory")
			require.NoError(t, err)
			defer os.Remove(f.Name())
			defer f.Close()
			_, err = b.MemImportFromFD(int(f.Fd()))
			assert.ErrorIs(t, err, driver.ErrorInvalidValue, "a file that is no device memory")
		} else {
			_, err = a.MemExportToFD(h)
			assert.ErrorIs(t, err, driver.ErrorInvalidValue, "not created for file descriptors")
			fh, err := a.MemExportToFabric(h)
			require.NoError(t, err)
			hb, err = b.MemImportFromFabric(fh)
			require.NoError(t, err)
			_, err = b.MemImportFromFabric(driver.FabricHandle{})
			assert.ErrorIs(t, err, driver.ErrorInvalidValue)
		}
		pb := mapHere(t, b, hb, g, devB)
		assert.NotEqual(t, pa, pb, "each process maps at its own address")
		require.NoError(t, b.MemsetD8(pb.Add(100), 9, 1))
		got, err := a.Bytes(pa.Add(100), 1)
		require.NoError(t, err)
		assert.Equal(t, []byte{9}, got, "both map the same memory")
		ord, err := b.PointerGetAttribute(driver.PointerAttrDeviceOrdinal, pb)
		require.NoError(t, err)
		assert.EqualValues(t, 0, ord, "the memory is on the exporter's device")

		// The exporter lets go first; the importer's mapping keeps the memory.
		unmapHere(t, a, pa, g, h)
		got, err = b.Bytes(pb.Add(100), 1)
		require.NoError(t, err)
		assert.Equal(t, []byte{9}, got)
		unmapHere(t, b, pb, g, hb)
		assert.Zero(t, a.Live())
		assert.Zero(t, b.Live())
	}
}

func TestVMMConfig(t *testing.T) {
	noIMEX := fake.New(fake.Config{Fabric: true, NoIMEX: true})
	dev := driver.NewDevice(noIMEX, 0)
	ctx, err := dev.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, ctx.MakeCurrent())
	v, err := dev.Attribute(driver.AttrHandleTypeFabric)
	require.NoError(t, err)
	assert.Equal(t, 1, v, "the device supports fabric handles")
	_, err = noIMEX.MemCreate(fake.Granularity, driver.MemAllocationProp{Location: dev, HandleTypes: driver.MemHandleFabric})
	assert.ErrorIs(t, err, driver.ErrorNotPermitted, "but the host has no IMEX channel")

	noVMM := fake.New(fake.Config{NoVMM: true, Fabric: true})
	dev = driver.NewDevice(noVMM, 0)
	ctx, err = dev.PrimaryContext()
	require.NoError(t, err)
	require.NoError(t, ctx.MakeCurrent())
	for _, attr := range []driver.DeviceAttribute{driver.AttrVirtualMemoryManagement, driver.AttrHandleTypePosixFD, driver.AttrHandleTypeFabric} {
		v, err := dev.Attribute(attr)
		require.NoError(t, err)
		assert.Zero(t, v, "attribute %d", attr)
	}
	_, err = noVMM.MemAddressReserve(fake.Granularity, 0)
	assert.ErrorIs(t, err, driver.ErrorNotSupported)
}
