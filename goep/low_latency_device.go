package goep

import (
	"time"
	"unsafe"

	"github.com/pyep/pyep/goep/lowlatency"
)

// Low-latency mode on a device. A Backend whose memory the host cannot read (cuda) runs the
// calls through an engine of its own (LowLatencyEngines), with kernels that follow
// goep/lowlatency's layout and protocol over the same shared regions; goep's cpu path runs
// goep/lowlatency itself. The device engine queues its work on the caller's stream and returns.

// LowLatencyEngines is what such a Backend implements: the engine of one buffer of rank over
// regions (every rank's low-latency region as mapped here, numBytes each); tokens are every
// rank's region tokens, from which the backend learns which ranks share its device.
type LowLatencyEngines interface {
	NewLowLatencyEngine(rank int, regions []unsafe.Pointer, numBytes int64, tokens [][]byte) (DeviceLowLatency, error)
}

// DeviceLowLatency is one buffer's low-latency engine on a device.
type DeviceLowLatency interface {
	Engine
	// Launch queues a dispatch (or a combine) on c.Stream: with c.Hook only its send phase, and
	// the receive that the returned LLReceive queues later.
	Launch(combine bool, c *LLCall) (LLReceive, error)
	// Clean zeroes this rank's flags and acknowledgements (and with masks its masks) once the
	// device is idle; the caller passes a barrier of every rank before and after.
	Clean(s lowlatency.Shape, masks bool) error
	SetMask(p int, on bool) error
	Masks(out []int32) error
	SetTimeout(d time.Duration)
	// NextSend is the offset of the send area of the next call (zero-copy combine rows).
	NextSend(s lowlatency.Shape) (int64, error)
}

// LLReceive is the receive phase of a call launched with a hook.
type LLReceive interface {
	Finish(stream uintptr) error
}

// LLCall is one low-latency call as device addresses (0: absent) and sizes.
type LLCall struct {
	Shape                                                                    lowlatency.Shape
	NumTokens, NumTopk                                                       int
	UseFP8, RoundScale, UseUE8M0, ZeroCopy, LogFMT                           bool
	Hook                                                                     bool
	X, TopkIdx, TopkWeights                                                  uintptr
	RecvX, RecvScales, SrcInfo, LayoutRange, Count, CumStats, WaitStats, Out uintptr
	Stream                                                                   uintptr
}

// launchDevice queues a call on the device engine; with a hook, its receive is kept under a new
// seq, which it returns.
func (ll *lowLatency) launchDevice(combine bool, c *LLCall) (uint32, error) {
	op := "low_latency_dispatch"
	if combine {
		op = "low_latency_combine"
	}
	if err := lowlatency.SameShape(op, ll.shape, c.Shape); err != nil {
		return 0, llErr(err)
	}
	if back := ll.calls - 1; ll.calls >= 2 && ll.deviceHooks[back] != nil {
		return 0, Argf("%s: the receive hook of low-latency call %d (two calls back, same buffer half) has not been "+
			"called: at most two calls may await their hooks; call that hook first", op, back)
	}
	recv, err := ll.device.Launch(combine, c)
	if err != nil {
		return 0, llErr(err)
	}
	ll.calls, ll.shape = ll.calls+1, c.Shape
	if recv != nil {
		ll.deviceHooks[ll.calls] = recv
	}
	return ll.calls, nil
}

// checkDeviceCall checks what the cpu path's engine checks of a call's sizes, for a device
// engine, before anything is queued.
func checkDeviceCall(R int, s lowlatency.Shape, T, K int, fp8, round, ue8m0 bool) error {
	if _, err := lowlatency.NewLayout(R, s); err != nil {
		return llErr(err)
	}
	switch {
	case T < 0 || T > s.MaxTokens:
		return Argf("x: %d tokens, expected at most num_max_dispatch_tokens_per_rank = %d", T, s.MaxTokens)
	case K < 1 || K > lowlatency.MaxTopk:
		return Argf("topk_idx: %d experts a token, expected 1 to %d", K, lowlatency.MaxTopk)
	case ue8m0 && !(fp8 && round):
		return Argf("use_ue8m0=True needs use_fp8=True and round_scale=True")
	}
	return nil
}
