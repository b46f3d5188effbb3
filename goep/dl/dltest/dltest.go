// Package dltest is for tests that load NVIDIA's libraries from PyTorch's wheels: the Python layer
// tells the Go core where Python's packages are (PYEP_SITE_PACKAGES) in real use, and a test
// binary asks python3 itself.
package dltest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// UsePythonSitePackages sets PYEP_SITE_PACKAGES to python3's package directories, unless it or one
// of overrides (a variable that names the library itself, say) is already set, or python3 does
// not answer within 20 s. Call it from TestMain.
func UsePythonSitePackages(overrides ...string) {
	for _, v := range append(overrides, "PYEP_SITE_PACKAGES") {
		if os.Getenv(v) != "" {
			return
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "python3", "-c",
		"import site, sys; print(':'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))").Output()
	if err == nil {
		os.Setenv("PYEP_SITE_PACKAGES", strings.TrimSpace(string(out)))
	}
}

// Touch makes the empty file rel under root, with its directories, and returns its path: a fake
// installation for the library searches' tests.
func Touch(t testing.TB, root, rel string) string {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
