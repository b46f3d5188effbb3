// Package lowlatency is the reference of pyep's low-latency (LL) mode, DeepEP V1's
// low_latency_dispatch and low_latency_combine, over the shared low-latency regions of every
// rank (the cpu backend's shared memory; the cuda kernels follow the same layout and protocol).
//
// Each rank writes its tokens straight into the receivers' slots and then one flag per
// (expert, source rank); the receiver waits, bounded by the timeout, for the flag of every
// unmasked source and copies the rows out. The combine goes by rank: each rank first pushes its
// tokens' selections to every peer, then an expert's rank sends one row per (token, rank), the
// token's weighted partial sum over that rank's experts when it selected several, and one flag
// per rank (combine.go). A receiver on another node (Domain.Remote) is written
// only through remotePut and remoteSignal, whose contract (remote.go) the GPU's NVSHMEM version
// keeps; the receive side is the same for both paths. layout.go documents the region's layout and the
// protocol (sequence numbers instead of zeroing, the two halves, acknowledgements); the
// synchronization contract users see is docs/low-latency.md.
package lowlatency
