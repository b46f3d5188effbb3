package jit

import (
	"path/filepath"
	"sort"

	"github.com/pyep/pyep/goep/dl"
	"github.com/pyep/pyep/goep/env"
)

// nvidiaLibDirs are where NVIDIA's pip wheels put libnvrtc inside a site-packages directory:
// the CUDA 13 wheels bundle all libraries in nvidia/cu13, the CUDA 12 ones have one package per
// library (nvidia/cuda_nvrtc) or, later, nvidia/cu12. The newest CUDA comes first.
var nvidiaLibDirs = []string{"nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"}

// Candidates lists where LoadNVRTC looks for NVRTC, in order, as read through getenv:
//
//  1. PYEP_NVRTC, a file path. When set it is the only candidate: whoever sets it wants that
//     NVRTC, and silently using another one instead would hide the mistake.
//  2. The NVIDIA wheels in each directory of PYEP_SITE_PACKAGES (':'-separated; the Python layer
//     sets it from site.getsitepackages() and torch's location), then in the site-packages of
//     $VIRTUAL_ENV and $CONDA_PREFIX: this finds the NVRTC that PyTorch itself uses.
//  3. A CUDA toolkit: $CUDA_HOME/lib64, then /usr/local/cuda/lib64.
//  4. Bare sonames (libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so) for the dynamic loader's own
//     search (LD_LIBRARY_PATH, ldconfig).
//
// Entries of steps 2 and 3 are listed only if such files exist.
func Candidates(getenv func(string) string) []string {
	if p := getenv(env.NVRTC); p != "" {
		return []string{p}
	}
	return toolkitLibraries(getenv, nil, nvidiaLibDirs, "libnvrtc.so*", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
}

// toolkitLibraries lists the files named like glob (a CUDA toolkit library) that exist in, in
// order, the directories first, each site-packages directory's wheelDirs (NVIDIA's wheels),
// $CUDA_HOME/lib64 and /usr/local/cuda/lib64, then the bare sonames for the loader's own search.
// In a directory the longest version suffix comes first (libnvrtc.so.13.0.88 before
// libnvrtc.so.13 before libnvrtc.so); in practice they are links to one file.
func toolkitLibraries(getenv func(string) string, first, wheelDirs []string, glob string, sonames ...string) []string {
	dirs := append([]string(nil), first...)
	for _, sp := range dl.SitePackages(getenv) {
		for _, d := range wheelDirs {
			dirs = append(dirs, filepath.Join(sp, d))
		}
	}
	if home := getenv("CUDA_HOME"); home != "" {
		dirs = append(dirs, filepath.Join(home, "lib64"))
	}
	dirs = append(dirs, "/usr/local/cuda/lib64")
	var out []string
	seen := map[string]bool{}
	for _, d := range dirs {
		matches, _ := filepath.Glob(filepath.Join(d, glob))
		sort.Sort(sort.Reverse(sort.StringSlice(matches)))
		for _, m := range matches {
			if !seen[m] {
				seen[m] = true
				out = append(out, m)
			}
		}
	}
	return append(out, sonames...)
}
