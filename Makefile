# pyep: `pip install .` builds everything (Go >= 1.24 on PATH); `make test` checks it.
PYTHON  ?= python3
# The pytest suite runs once per group size, each rank a process under torchrun (gloo, cpu backend).
NPROCS  ?= 1 2 3 4 8
PYTEST  ?= -q -rs -p no:cacheprovider
export OMP_NUM_THREADS ?= 1

.PHONY: install test go-test py-test fmt

install:
	$(PYTHON) -m pip install .

test: go-test py-test

go-test:
	go vet ./...
	go test -timeout 30m ./...

# Tests import the installed pyep (run `make install` first); run from tests/ so that the
# repository's pyep/ folder (the gopy package's Go sources) is not on sys.path.
py-test:
	@set -e; for n in $(NPROCS); do \
		echo "== pytest under torchrun, $$n process(es)"; \
		(cd tests && $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $$n -m pytest $(PYTEST) .); \
	done

fmt:
	gofmt -w $$(git ls-files '*.go')
	go tool goimports -w $$(git ls-files '*.go')
