package normal

import (
	"fmt"
	"math"
)

// Config is the intranode part of DeepEP's deep_ep.Config.
type Config struct {
	NumSMs                     int // channels = NumSMs / 2
	NumMaxNVLChunkedSendTokens int // most tokens a sender pushes into a ring per step
	NumMaxNVLChunkedRecvTokens int // slots of every ring
}

// Validate checks the rules DeepEP asserts: an even positive SM count and
// 0 < send < recv (a sender waits for room of a whole chunk, so a chunk must
// be strictly smaller than the ring).
func (cfg Config) Validate() error {
	if cfg.NumSMs <= 0 || cfg.NumSMs%2 != 0 || cfg.NumSMs > 4096 {
		return newErr(ErrInvalid, "config: num_sms = %d must be even, positive and at most 4096", cfg.NumSMs)
	}
	if cfg.NumMaxNVLChunkedSendTokens <= 0 || cfg.NumMaxNVLChunkedSendTokens >= cfg.NumMaxNVLChunkedRecvTokens {
		return newErr(ErrInvalid, "config: need 0 < num_max_nvl_chunked_send_tokens (%d) < num_max_nvl_chunked_recv_tokens (%d)",
			cfg.NumMaxNVLChunkedSendTokens, cfg.NumMaxNVLChunkedRecvTokens)
	}
	if cfg.NumMaxNVLChunkedRecvTokens > 1<<20 {
		return newErr(ErrInvalid, "config: num_max_nvl_chunked_recv_tokens = %d is too large", cfg.NumMaxNVLChunkedRecvTokens)
	}
	return nil
}

// NumChannels is the number of channels (NumSMs / 2).
func (cfg Config) NumChannels() int { return cfg.NumSMs / 2 }

func (cfg Config) String() string {
	return fmt.Sprintf("num_sms=%d, num_max_nvl_chunked_send_tokens=%d, num_max_nvl_chunked_recv_tokens=%d",
		cfg.NumSMs, cfg.NumMaxNVLChunkedSendTokens, cfg.NumMaxNVLChunkedRecvTokens)
}

// channelRange is the token range [lo, hi) of channel ch when numTokens
// tokens are split over numChannels channels (DeepEP's get_channel_task_range).
func channelRange(numTokens, numChannels, ch int) (lo, hi int) {
	per := (numTokens + numChannels - 1) / numChannels
	return min(ch*per, numTokens), min(ch*per+per, numTokens)
}

func align(n, a int64) int64 { return (n + a - 1) / a * a }

// NVLBufferSizeHint is DeepEP's Config.get_nvl_buffer_size_hint(hidden_bytes,
// num_ranks) for one NVLink domain: room for per-ring metadata and, per ring
// slot, the hidden row, the source meta, 128 top-k indices and weights and
// 128 float scales. The rings of Dispatch (top-k up to 128, scales up to 512
// bytes per token) and Combine (rows up to hiddenBytes) always fit in it.
func NVLBufferSizeHint(cfg Config, hiddenBytes, numRanks int) int64 {
	c, r, recv := int64(cfg.NumChannels()), int64(numRanks), int64(cfg.NumMaxNVLChunkedRecvTokens)
	n := c * r * (2*1 + 3) * 4
	n += c * r * recv * int64(hiddenBytes)
	n += c * r * recv * 8
	n += c * r * recv * 128 * 8
	n += c * r * recv * 128 * 4
	n += c * r * recv * 128 * 4
	return align(n, 128)
}

// ringLayout places the rings of one call in a receiver's data region. Ring
// i = channel*R + sender. The region starts with the tail words of all rings
// (written by the senders), then the head words (written by the receiver, in
// other cache lines than the tails), then one array per slot field, each
// holding all slots of all rings:
//
//	[tails: C*R u64][heads: C*R u64][field 0: C*R*slots*size0]...[field n]
//
// Fields are ordered by decreasing alignment so that each array is naturally
// aligned without padding (typed fields: int64 top-k, float32 weights,
// int32 source index; the opaque byte fields come last).
type ringLayout struct {
	rings, slots int64
	fieldOff     []int64 // start of each field array
	fieldSize    []int64 // bytes per slot of each field
	total        int64
}

func newRingLayout(numChannels, numRanks, slots int, fieldSizes ...int64) ringLayout {
	l := ringLayout{rings: int64(numChannels) * int64(numRanks), slots: int64(slots)}
	off := 16 * l.rings
	for _, s := range fieldSizes {
		l.fieldOff = append(l.fieldOff, off)
		l.fieldSize = append(l.fieldSize, s)
		off += l.rings * l.slots * s
	}
	l.total = off
	return l
}

func (l *ringLayout) tailOff(ring int) int64 { return 8 * int64(ring) }
func (l *ringLayout) headOff(ring int) int64 { return 8 * (l.rings + int64(ring)) }
func (l *ringLayout) slotOff(field, ring int, slot int64) int64 {
	return l.fieldOff[field] + (int64(ring)*l.slots+slot)*l.fieldSize[field]
}

// Fields of the dispatch rings.
const (
	dfTopk   = iota // int64 [K]: local expert index or -1
	dfWeight        // float32 [K]
	dfSrc           // int32: source token index
	dfScales        // scalesBytes
	dfHidden        // hiddenBytes
)

func dispatchLayout(cfg Config, numRanks, hiddenBytes, scalesBytes, numTopk int) ringLayout {
	k := int64(numTopk)
	return newRingLayout(cfg.NumChannels(), numRanks, cfg.NumMaxNVLChunkedRecvTokens,
		8*k, 4*k, 4, int64(scalesBytes), int64(hiddenBytes))
}

// Fields of the combine rings.
const (
	cfWeight = iota // float32 [K]
	cfSrc           // int32: source token index on the receiver, checked against send_head
	cfRow           // hidden * element size
)

func combineLayout(cfg Config, numRanks, rowBytes, numTopk int) ringLayout {
	return newRingLayout(cfg.NumChannels(), numRanks, cfg.NumMaxNVLChunkedRecvTokens,
		4*int64(numTopk), 4, int64(rowBytes))
}

// DispatchBufferBytes is the data region size Dispatch needs.
func DispatchBufferBytes(cfg Config, numRanks, hiddenBytes, scalesBytes, numTopk int) int64 {
	l := dispatchLayout(cfg, numRanks, hiddenBytes, scalesBytes, numTopk)
	return l.total
}

// CombineBufferBytes is the data region size Combine needs for rows of
// rowBytes (hidden * element size).
func CombineBufferBytes(cfg Config, numRanks, rowBytes, numTopk int) int64 {
	l := combineLayout(cfg, numRanks, rowBytes, numTopk)
	return l.total
}

// notifyLayout: the scratch Notify uses in a receiver's data region: one
// flag word per sender, then per sender a block of int32 (the sender's
// tokens per rank [R], its tokens to this rank per channel [C], its tokens
// per local expert of this rank [E/R]).
type notifyLayout struct {
	flagsBytes, blockBytes, total int64
}

func newNotifyLayout(numRanks, numChannels, numExperts int) notifyLayout {
	r := int64(numRanks)
	l := notifyLayout{flagsBytes: 8 * r}
	l.blockBytes = align(4*(r+int64(numChannels)+int64(numExperts)/r), 8)
	l.total = l.flagsBytes + r*l.blockBytes
	return l
}

func (l notifyLayout) flagOff(src int) int64  { return 8 * int64(src) }
func (l notifyLayout) blockOff(src int) int64 { return l.flagsBytes + int64(src)*l.blockBytes }

// NotifyBufferBytes is the data region size Notify needs.
func NotifyBufferBytes(numRanks, numChannels, numExperts int) int64 {
	return newNotifyLayout(numRanks, numChannels, numExperts).total
}

// checkBuffer reports a data region too small for what a call needs.
func checkBuffer(op string, d *Domain, need int64, detail string) error {
	if need > d.NumBytes {
		return newErr(ErrInvalid, "%s: rank %d: num_nvl_bytes = %d is too small: %s need %d bytes",
			op, d.Rank, d.NumBytes, detail, need)
	}
	return nil
}

// maxTokens bounds token counts so that they fit the 32-bit fields of the
// ring tail words and the int32 outputs.
const maxTokens = math.MaxInt32 - 1
