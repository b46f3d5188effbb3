package dl

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSitePackages(t *testing.T) {
	root := t.TempDir()
	venv := filepath.Join(root, "venv/lib/python3.12/site-packages")
	conda := filepath.Join(root, "conda/lib/python3.11/site-packages")
	for _, d := range []string{venv, conda} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	env := map[string]string{
		"PYEP_SITE_PACKAGES": "/a::/b",
		"VIRTUAL_ENV":        filepath.Join(root, "venv"),
		"CONDA_PREFIX":       filepath.Join(root, "conda"),
	}
	assert.Equal(t, []string{"/a", "/b", venv, conda}, SitePackages(func(k string) string { return env[k] }))
	assert.Empty(t, SitePackages(func(string) string { return "" }))
}
