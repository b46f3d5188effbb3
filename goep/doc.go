// Package goep is pyep's core: the Buffer that owns an expert-parallel group's communication
// memory, its lifecycle (allocate, exchange handles, sync with peers, destroy), the rank
// arithmetic of NVLink domains, configs and their size hints, and validation.
//
// Memory and launches are delegated to a Backend (goep/cpu: shared memory between processes;
// goep/cuda: device memory and CUDA IPC), chosen by the caller.
package goep
