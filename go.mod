module github.com/pyep/pyep

go 1.24

tool (
	github.com/go-python/gopy
	golang.org/x/tools/cmd/goimports
)

require (
	github.com/NVIDIA/go-nvml v0.13.0-1
	github.com/go-python/gopy v0.5.0
	github.com/stretchr/testify v1.11.1
)

require (
	github.com/davecgh/go-spew v1.1.1 // indirect
	github.com/gonuts/commander v0.1.0 // indirect
	github.com/gonuts/flag v0.1.0 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/pmezard/go-difflib v1.0.0 // indirect
	golang.org/x/mod v0.24.0 // indirect
	golang.org/x/sync v0.14.0 // indirect
	golang.org/x/tools v0.33.0 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
)
