package cudanormal

// Shape is how a dispatch or combine kernel runs: its block size, and the vectors a lane keeps in
// flight when a warp copies a row (kernels/copy.cuh's U, PYEP_COPY_UNROLL in intranode.cu). Every
// rank of a call takes the same: both ends of a ring derive its sub-rings from the block size
// (kernels/protocol.cuh's sub_rings), and the choice depends only on the op and the rank count.
type Shape struct{ Threads, Unroll int }

// Op is what a Shape is chosen for.
type Op int8

// The ops with a shape of their own.
const (
	OpDispatch        Op = iota // rows without scales (BF16), queued: notify in the kernel's first block
	OpDispatchCounted           // rows without scales, the counts known before the launch: a cached dispatch, or one after its notify
	OpDispatchFP8               // rows with scales
	OpCombine
)

// baseShape is the shape of every op and rank count that shapes does not name.
var baseShape = Shape{768, 8}

// shapes are the fastest of a sweep of block sizes (384 to 1024) and unrolls (2 to 16) on H200s,
// one rank a GPU, at 4096 tokens, hidden 7168, top-8 of 256 experts, 24 SMs (pyep.bench; figures
// in bench/results/h200-2026-11-27-shapes), by op and rank count; the zero Shape is baseShape.
// Where no shape was faster than the noise (FP8 dispatch at 2 and 4 ranks), the base stays; at 4
// ranks the cached dispatch was 2% slower in the queued dispatch's shape, and DeepEP's harness
// (which times it) agreed. The combine at 2 ranks took 768 threads once the sending block reduced
// too (204.5 µs against 212.3 at 1024, bench/results/h200x2-2026-11-27-combine). An array, not a
// map: every call looks its shape up.
var shapes = [OpCombine + 1][8 + 1]Shape{ // by op, then ranks (1 to 8)
	OpDispatch:        {2: {896, 4}, 4: {1024, 4}},
	OpDispatchCounted: {2: {896, 4}},
	OpCombine:         {2: {768, 4}, 4: {512, 8}},
}

// ShapeFor is op's shape at ranks ranks: the table's, with threads and unroll in its place where
// they are not zero (NormalOptions' Threads and Unroll: PYEP_NORMAL_THREADS and PYEP_COPY_UNROLL, or
// a test's). A block has a warp for each rank and one more at least.
func ShapeFor(op Op, ranks, threads, unroll int) Shape {
	var s Shape
	if op >= 0 && int(op) < len(shapes) && ranks >= 0 && ranks < len(shapes[op]) {
		s = shapes[op][ranks]
	}
	if s == (Shape{}) {
		s = baseShape
	}
	if threads != 0 {
		s.Threads = threads
	}
	if unroll != 0 {
		s.Unroll = unroll
	}
	s.Threads = max(s.Threads, 32*(ranks+1))
	return s
}
