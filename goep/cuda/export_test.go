package cuda

import (
	"io"
	"os"
	"sync"
)

// TokenKind names how a LocalRegion's token shares its memory: "ipc", "fd" or "fabric".
func TokenKind(tok []byte) string {
	t, err := decodeToken(tok)
	if err != nil {
		return "invalid: " + err.Error()
	}
	return map[memKind]string{kindIPC: "ipc", kindFD: "fd", kindFabric: "fabric"}[t.Kind]
}

// CaptureFallbackLog sends AllocateFabric's once-per-process line to w, as if no allocation
// had written it yet, until restore.
func CaptureFallbackLog(w io.Writer) (restore func()) {
	fallbackLog, fallbackOnce = w, sync.Once{}
	return func() { fallbackLog, fallbackOnce = os.Stderr, sync.Once{} }
}
