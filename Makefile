# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: venv system-deps demo test test-fast bench clean

$(STAMP): pyproject.toml setup.py constraints.txt sdk/protocol/agent.proto
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing torch (CPU build pinned in constraints.txt) and sparecycles[broker,agent,sdk,dev]"
	$(PIP) "torch==2.13.0"
	$(PIP) -e '.[broker,agent,sdk,dev]'
	touch $(STAMP)

venv: $(STAMP)

# bubblewrap sandboxes plugin hosts; libseccomp backs its syscall filter; chromium drives
# the console's browser tests; prometheus scrapes a live broker in tests/e2e; systemd-analyze
# verifies infra/systemd; podman (runc: crun refuses this machine's hybrid cgroups) builds and
# runs the broker image on a base debootstrap makes (no registry is reachable). Installed when
# missing and we are root with apt (CI, fresh dev machines); otherwise say what to do.
system-deps:
	@if ! command -v bwrap >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing bubblewrap and libseccomp2 (apt)"; \
	    (apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q bubblewrap libseccomp2 >/dev/null)); \
	  else \
	    echo "!! bubblewrap is missing: install it (e.g. apt-get install bubblewrap); sandbox tests will be skipped"; \
	  fi; \
	fi
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing chromium for the admin console's browser tests (apt)"; \
	    (apt-get install -y -q chromium >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)); \
	  else \
	    echo "!! chromium is missing: install it (apt-get install chromium); browser tests will be skipped"; \
	  fi; \
	fi
	@if ! command -v tmux >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing tmux for the terminal tests of the CLI and the agent status view (apt)"; \
	    (apt-get install -y -q tmux >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q tmux >/dev/null)); \
	  else \
	    echo "!! tmux is missing: install it (apt-get install tmux); the terminal tests will be skipped"; \
	  fi; \
	fi
	@if ! command -v prometheus >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing prometheus for the metrics tests (apt; its service is not started)"; \
	    (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null)); \
	  else \
	    echo "!! prometheus is missing: install it (apt-get install prometheus); the Prometheus test will be skipped"; \
	  fi; \
	fi

	@if ! command -v systemd-analyze >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing systemd for systemd-analyze verify of infra/systemd (apt; nothing is started)"; \
	    (apt-get install -y -q --no-install-recommends systemd >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends systemd >/dev/null)); \
	  else \
	    echo "!! systemd-analyze is missing: install systemd; the unit verification test will be skipped"; \
	  fi; \
	fi
	@if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing podman, runc and debootstrap to build and run the broker image (apt)"; \
	    (apt-get install -y -q --no-install-recommends podman runc crun netavark debootstrap >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends podman runc crun netavark debootstrap >/dev/null)); \
	  else \
	    echo "!! podman, runc or debootstrap is missing: install them; the broker image test will be skipped"; \
	  fi; \
	fi
	@if ! command -v docker-compose >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> installing docker-compose to check infra/compose*.yaml against the Compose Specification (apt; no daemon)"; \
	    (apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends docker-compose >/dev/null)); \
	  else \
	    echo "!! docker-compose is missing: install it; the compose file check will be skipped"; \
	  fi; \
	fi

demo: $(STAMP) system-deps
	$(BIN)/sparecycles demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

# Unit and integration tests only (no real processes); seconds, not minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/integration

bench: $(STAMP)
	$(BIN)/python bench/dispatch.py --svg out/bench-dispatch.svg

# The demo's folder (its broker, agents and logs) is in the user cache dir; a broker's data
# dir (~/.local/share/sparecycles/broker by default) holds real keys and is never removed here.
# .sparecycles and .sparecycles-demo are where older versions kept them.
clean:
	rm -rf $(VENV) .sparecycles .sparecycles-demo out build *.egg-info
	rm -rf "$${SPARECYCLES_CACHE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/sparecycles}/demo"
	find . -name '*_pb2*.py' -path './sdk/*' -delete
