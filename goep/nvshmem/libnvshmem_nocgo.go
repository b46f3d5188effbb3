//go:build !cgo

package nvshmem

// Without cgo there is no dlopen, hence no NVSHMEM: Open says so, and no Library exists to call
// the rest on.
func load([]string) (*Library, error) { return nil, errNoCgo }

func (l *Library) GetUniqueID() (UniqueID, error)    { return UniqueID{}, errNoCgo }
func (l *Library) Init(Group) error                  { return errNoCgo }
func (l *Library) InitStatus() int                   { return 0 }
func (l *Library) Finalize() error                   { return errNoCgo }
func (l *Library) Malloc(int) (uintptr, error)       { return 0, errNoCgo }
func (l *Library) Free(uintptr) error                { return errNoCgo }
func (l *Library) BarrierAll() error                 { return errNoCgo }
func (l *Library) Ptr(uintptr, int) (uintptr, error) { return 0, errNoCgo }
func (l *Library) ModuleInit(uintptr) error          { return errNoCgo }
func (l *Library) ModuleFinalize(uintptr) error      { return errNoCgo }
