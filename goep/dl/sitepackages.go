package dl

import (
	"path/filepath"
	"strings"

	"github.com/pyep/pyep/goep/env"
)

// SitePackages lists the Python site-packages directories where NVIDIA's wheels (NVRTC,
// nvJitLink, NVSHMEM: those PyTorch installs) may be, as read through getenv: each directory of
// PYEP_SITE_PACKAGES (':'-separated; the Python layer sets it from site.getsitepackages() and
// torch's location), then the site-packages of $VIRTUAL_ENV and $CONDA_PREFIX. The libraries'
// finders (goep/jit, goep/nvshmem) look under these for their nvidia/<package>/lib.
func SitePackages(getenv func(string) string) []string {
	var out []string
	for _, sp := range strings.Split(getenv(env.SitePackages), ":") {
		if sp != "" {
			out = append(out, sp)
		}
	}
	for _, name := range []string{"VIRTUAL_ENV", "CONDA_PREFIX"} {
		if prefix := getenv(name); prefix != "" {
			matches, _ := filepath.Glob(filepath.Join(prefix, "lib", "python3*", "site-packages"))
			out = append(out, matches...)
		}
	}
	return out
}
