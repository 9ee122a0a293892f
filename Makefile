# `make demo` and `make test` are the first two commands on a fresh machine (README "Quick start").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# vLLM's CPU build where no NVIDIA GPU answers, upstream vLLM (CUDA) where one does.
EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
PYTEST_ARGS ?=
# Two pytest workers: tests/e2e's vLLM clusters on one, everything else beside it (tests/conftest.py).
# PYTEST_WORKERS=0 runs the suite in one process, in file order.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadgroup)

.PHONY: setup model copy-models redis etcd chromium prometheus demo test test-loaded test-slow lint clean vllm-compat

# $(call progress,WHAT,COMMAND): runs COMMAND, saying every 15 s what it waits for and for how long
# (a comma in COMMAND is written $(comma)).
comma := ,
progress = @t0=$$(date +%s); ( while sleep 15; do echo "  ... $(1): $$(( $$(date +%s) - t0 ))s"; done ) & \
	tick=$$!; ( $(2) ); rc=$$?; kill $$tick 2>/dev/null; \
	[ $$rc = 0 ] && echo "  $(1): done in $$(( $$(date +%s) - t0 ))s"; exit $$rc

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "kvferry needs Python >= 3.11"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing kvferry[$(EXTRA),test] into $(VENV) (about 2 minutes the first time; pip's log: $(VENV)/install.log)"
	@# The CPU build needs torch 2.13.0 (a local wheel here); installing it first stops pip
	@# from pulling a CUDA torch from the index.
	@# pip's output goes to a log (it is long and noisy); its tail is shown if it fails.
	$(call progress,installing torch and kvferry's dependencies,\
		if [ "$(EXTRA)" = cpu ]; then $(PIP) install torch==2.13.0 > $(VENV)/install.log 2>&1 \
		|| { tail -40 $(VENV)/install.log; exit 1; }; fi; \
	$(PIP) install -e ".[$(EXTRA)$(comma)test]" >> $(VENV)/install.log 2>&1 || { tail -40 $(VENV)/install.log; exit 1; })
	@# vLLM pulls these in; their CUDA builds break the CPU torch.
	if [ "$(EXTRA)" = cpu ]; then $(PIP) uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

setup: $(VENV)/.installed

# The random-weight Llama: what the demo serves and most tests read (about 20 s).
model: setup
	$(call progress,building the tiny model,$(VENV)/bin/kvferry make-tiny-model)

# The copy models only the cachegen quality tests read, trained here once (about 2.5 minutes each
# on one core, the two side by side); `make test` builds them, `make demo` does not.
copy-models: setup
	$(call progress,training the copy models (cachegen's quality tests),\
		$(VENV)/bin/kvferry make-tiny-model --arch deepseek-copy & pid=$$!; \
		$(VENV)/bin/kvferry make-tiny-model --arch llama-copy; rc=$$?; wait $$pid && exit $$rc)

demo: setup model
	$(VENV)/bin/kvferry up

# redis-server (and libibverbs1 for Mooncake) for the remote-tier tests (Debian's package, installed where it is missing and apt
# is usable as root; elsewhere those tests skip, or fail under CI=true (.ci/run).
redis:
	@if ! command -v redis-server >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing redis-server (apt-get; about 30 s)"; \
			{ apt-get install -y --no-install-recommends redis-server || { apt-get update && \
			  apt-get install -y --no-install-recommends redis-server; }; } > /tmp/kvferry-redis-install.log 2>&1 \
			|| { tail -20 /tmp/kvferry-redis-install.log; exit 1; }; \
		else echo "redis-server not found and apt-get not usable: the remote-tier tests will skip" \
			"(install redis-server yourself)"; fi; \
	fi
	@# mooncake_master and Mooncake's client (the cpu/cuda extras) link libibverbs even over TCP.
	@if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			{ apt-get install -y --no-install-recommends libibverbs1 || { apt-get update && \
			  apt-get install -y --no-install-recommends libibverbs1; }; } > /tmp/kvferry-ibverbs-install.log 2>&1 \
			|| { tail -20 /tmp/kvferry-ibverbs-install.log; exit 1; }; \
		else echo "libibverbs1 not found and apt-get not usable: the Mooncake tests will fail" \
			"(apt-get install libibverbs1)"; fi; \
	fi

# etcd for the discovery tests (Debian's etcd-server; same rules as redis).
etcd:
	@if ! command -v etcd >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing etcd-server (apt-get; about 20 s)"; \
			{ apt-get install -y --no-install-recommends etcd-server || { apt-get update && \
			  apt-get install -y --no-install-recommends etcd-server; }; } > /tmp/kvferry-etcd-install.log 2>&1 \
			|| { tail -20 /tmp/kvferry-etcd-install.log; exit 1; }; \
		else echo "etcd not found and apt-get not usable: the discovery tests will skip" \
			"(install etcd-server yourself)"; fi; \
	fi

# Headless Chromium for the controller web page's screenshot test (same rules as redis).
chromium:
	@if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing chromium-headless-shell (apt-get; about 20 s)"; \
			{ apt-get install -y --no-install-recommends chromium-headless-shell || { apt-get update && \
			  apt-get install -y --no-install-recommends chromium-headless-shell; }; } \
			> /tmp/kvferry-chromium-install.log 2>&1 || { tail -20 /tmp/kvferry-chromium-install.log; exit 1; }; \
		else echo "chromium-headless-shell not found and apt-get not usable: the web page test will skip" \
			"(install chromium yourself)"; fi; \
	fi

# Prometheus and promtool for the dashboard and alert tests (Debian's prometheus; same rules as redis).
prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing prometheus (apt-get; about 30 s)"; \
			{ apt-get install -y --no-install-recommends prometheus || { apt-get update && \
			  apt-get install -y --no-install-recommends prometheus; }; } \
			> /tmp/kvferry-prometheus-install.log 2>&1 || { tail -20 /tmp/kvferry-prometheus-install.log; exit 1; }; \
		else echo "prometheus not found and apt-get not usable: the dashboard and alert tests will skip" \
			"(install prometheus yourself)"; fi; \
	fi

test: setup model copy-models redis etcd chromium prometheus
	$(PY) -m pytest -q $(XDIST) --durations=15 -m "not slow" $(PYTEST_ARGS)

# `make test` beside busy loops, one per core, at normal priority: how a timing assumption that a
# loaded machine breaks is found before CI finds it (docs/testing.md says when to run it).
test-loaded: setup model copy-models redis etcd chromium prometheus
	@n=$$(nproc); echo "make test beside $$n busy loops"; pids=; \
	for i in $$(seq $$n); do $(PYTHON) -c 'while True: pass' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest -q $(XDIST) --durations=15 -m "not slow" $(PYTEST_ARGS)

# The tests `make test` leaves out for CI's time budget (marked `slow`: TP=2 vLLM servers).
test-slow: setup model copy-models redis etcd chromium prometheus
	$(PY) -m pytest -q $(XDIST) --durations=15 -m slow $(PYTEST_ARGS)

# The connector's API check against every vLLM release in the cuda extra's range (docs/compatibility.md):
# the installed vLLM from its files, the others from their wheels, downloaded once (~340 MB each) into
# ~/.cache/kvferry/wheels and read without installing. Not part of `make test`: the downloads cost CI
# minutes and network. `make test` checks the installed vLLM and any wheel already in that cache.
vllm-compat: setup
	$(PY) benchmarks/vllm_compat.py

# ruff on everything (line length 120), mypy on the library (pyproject's [tool.mypy]); both must be clean.
LIBRARY := common proxy sender receiver buffer kernels engine connector controller launcher testing
MYPY_TREE := $(VENV)/mypy-tree
lint: setup
	$(VENV)/bin/ruff check .
	@# mypy cannot see through setuptools' editable finder: it reads each folder through a link named as
	@# its package (kvferry/<folder>), the layout an installed wheel has.
	@mkdir -p $(MYPY_TREE)/kvferry && for p in $(LIBRARY); do ln -sfn $(CURDIR)/$$p $(MYPY_TREE)/kvferry/$$p; done
	cd $(MYPY_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml $(foreach p,$(LIBRARY),-p kvferry.$(p))

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
