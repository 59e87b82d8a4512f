# One place for the commands a newcomer, a developer and CI run.
#   make demo   set up, build, and run the demo on a built-in simulated dataset (CPU without a GPU)
#   make test   set up, build, and run every test: Rust (unit, integration, property) and Python
PYTHON ?= python3
CARGO  ?= cargo
DEMO_OUT ?= quantem-demo

.PHONY: setup build demo test test-rust test-python lint wheel bench-cpu

setup:
	./scripts/setup.sh

build: setup
	$(CARGO) build --release -p qem-cli

demo: build
	./target/release/quantem-gpu demo --out $(DEMO_OUT)

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings
	$(PYTHON) -m ruff check python tests bench
	$(PYTHON) -m ruff format --check python tests bench

test-rust: setup
	$(CARGO) test --release

wheel: setup
	rm -rf dist
	./scripts/stage_cli.sh
	$(PYTHON) -m maturin build --release --quiet -o dist
	$(PYTHON) -m pip install --quiet --force-reinstall --no-deps dist/quantem_gpu-*.whl

test-python: wheel
	$(PYTHON) -m pytest -q tests/python

test: lint test-rust test-python

bench-cpu: build
	$(CARGO) build --release -p qem-bench --bin qem-bench
	./target/release/qem-bench load --h5py --out bench/results
