# kvrouter — build, test and run. `make help` lists the targets.
GO        ?= go
BIN       ?= bin
PKGS      ?= ./...
FUZZTIME  ?= 30s
# Brief fuzzing inside `make test`; `make fuzz` runs longer.
TESTFUZZTIME ?= 5s
BINARIES  := kvrouter kvbridge kvsim kvbench kvctl

# Build identity that every binary's --version prints (internal/version).
# Overridable: `make image` passes both into the Docker build, whose context
# has no .git. Outside a git checkout they fall back to dev/unknown.
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT      ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
VERSION_PKG := github.com/kvrouter/kvrouter/internal/version
# The one set of build flags, used by `make build` and by deploy/Dockerfile
# (which runs `make build`): static (pure Go, ZMQ included), reproducible
# paths, no symbol table (stack traces keep their function names).
LDFLAGS     := -s -w -X $(VERSION_PKG).version=$(VERSION) -X $(VERSION_PKG).commit=$(COMMIT)
GOBUILD      = CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)'
# The image the Kubernetes manifests and the Helm chart reference
# (deploy's test checks they agree).
IMAGE       ?= ghcr.io/kvrouter/kvrouter
IMAGE_TAG   ?= $(VERSION)
DOCKER      ?= docker
# e.g. --network host where the daemon has no bridge network
IMAGE_BUILD_FLAGS ?=

.PHONY: help build image image-check test test-short vet lint fmt bench fuzz fuzz-brief run demo clean deps-test proto

help: ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build every binary into ./bin, stamped with VERSION and COMMIT
	@mkdir -p $(BIN)
	$(GOBUILD) -o $(BIN)/ $(addprefix ./cmd/,$(BINARIES))

image: ## build the container image $(IMAGE):$(IMAGE_TAG) (deploy/Dockerfile: multi-stage, distroless, non-root)
	DOCKER_BUILDKIT=1 $(DOCKER) build $(IMAGE_BUILD_FLAGS) -f deploy/Dockerfile --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) \
		-t $(IMAGE):$(IMAGE_TAG) .

image-check: ## build the image and run it: non-root, --version of every binary, kvrouter in front of kvsim in containers (scripts/image-check.sh)
	DOCKER=$(DOCKER) IMAGE=$(IMAGE) IMAGE_TAG=$(IMAGE_TAG) IMAGE_BUILD_FLAGS="$(IMAGE_BUILD_FLAGS)" scripts/image-check.sh

vet: ## go vet
	$(GO) vet $(PKGS)

lint: vet ## gofmt check + go vet
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

fmt: ## gofmt -w
	gofmt -w $$(git ls-files '*.go')

deps-test: ## make sure what the tests need is installed (redis-server)
	@./scripts/ensure-test-deps.sh

test: lint deps-test ## vet, gofmt, race tests, brief fuzzing
	$(GO) test -race -count=1 -timeout 40m $(PKGS)
	# deploy/ is its own module (Kubernetes deps kept out of the main one): docs/deploy.md
	cd deploy && $(GO) vet ./... && $(GO) test -count=1 -timeout 15m ./...
	@$(MAKE) --no-print-directory fuzz-brief

test-short: ## quick tests without the race detector
	$(GO) test -count=1 -short $(PKGS)

fuzz-brief:
	@./scripts/fuzz.sh $(TESTFUZZTIME)

fuzz: ## run every fuzz target for FUZZTIME each (default 30s)
	@./scripts/fuzz.sh $(FUZZTIME)

bench: ## Go benchmarks of the hot paths
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

run: build ## run kvrouter with examples/router.yaml
	$(BIN)/kvrouter --config examples/router.yaml

demo: build ## embedded NATS + 4 simulated vLLM instances + bridges + router; compares strategies
	$(BIN)/kvbench demo

# Pinned protoc plugins for `make proto`, installed into $(BIN)/tools.
PROTOC_GEN_GO_VERSION      ?= v1.36.12
PROTOC_GEN_GO_GRPC_VERSION ?= v1.5.1
TOOLS ?= $(CURDIR)/$(BIN)/tools

proto: ## regenerate api/kvrouter/v1 (protoc from Debian's protobuf-compiler, pinned Go plugins)
	@command -v protoc >/dev/null || apt-get install -y protobuf-compiler || { echo "protoc missing: apt-get install -y protobuf-compiler"; exit 1; }
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(TOOLS) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	PATH=$(TOOLS):$$PATH protoc -I api -I /usr/include \
		--go_out=api --go_opt=paths=source_relative \
		--go-grpc_out=api --go-grpc_opt=paths=source_relative \
		kvrouter/v1/kvrouter.proto

clean:
	rm -rf $(BIN)
