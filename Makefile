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
	@sh scripts/apt-need.sh bwrap "bubblewrap libseccomp2" "for the plugin sandbox" "the sandbox tests"
	@sh scripts/apt-need.sh chromium chromium "for the admin console's browser tests" "the browser tests"
	@sh scripts/apt-need.sh tmux tmux "for the terminal tests of the CLI and the agent status view" \
	  "the terminal tests"
	@sh scripts/apt-need.sh prometheus prometheus "for the metrics tests (its service is not started)" \
	  "the Prometheus test" --no-install-recommends
	@sh scripts/apt-need.sh systemd-analyze systemd "for systemd-analyze verify of infra/systemd (nothing is started)" \
	  "the unit verification test" --no-install-recommends
	@sh scripts/apt-need.sh "podman runc debootstrap" "podman runc crun netavark debootstrap" \
	  "to build and run the broker image" "the broker image test" --no-install-recommends
	@sh scripts/apt-need.sh docker-compose docker-compose \
	  "to check infra/compose*.yaml against the Compose Specification (no daemon)" \
	  "the compose file check" --no-install-recommends

demo: $(STAMP) system-deps
	$(BIN)/sparecycles demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

# Unit and integration tests only (no real processes); seconds, not minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/integration

# The dispatch bench on SQLite and, when a PostgreSQL server answers at BENCH_PG (the
# machine's own by default), on PostgreSQL too: one table each, one SVG.
BENCH_PG ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
bench: $(STAMP)
	@if $(BIN)/python -c "import sys, sqlalchemy as s; s.create_engine(sys.argv[1], connect_args={'connect_timeout': 3}).connect().close()" "$(BENCH_PG)" 2>/dev/null; then \
	  dbs="sqlite,$(BENCH_PG)"; \
	else \
	  echo "==> no PostgreSQL at $(BENCH_PG) (set BENCH_PG=postgresql+psycopg://…): SQLite only"; dbs=sqlite; \
	fi; \
	echo "==> bench/dispatch.py --db $$dbs --svg out/bench-dispatch.svg"; \
	$(BIN)/python bench/dispatch.py --db "$$dbs" --svg out/bench-dispatch.svg

# The demo's folder (its broker, agents and logs) is in the user cache dir; a broker's data
# dir (~/.local/share/sparecycles/broker by default) holds real keys and is never removed here.
# .sparecycles and .sparecycles-demo are where older versions kept them.
clean:
	rm -rf $(VENV) .sparecycles .sparecycles-demo out build *.egg-info
	rm -rf "$${SPARECYCLES_CACHE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/sparecycles}/demo"
	find . -name '*_pb2*.py' -path './sdk/*' -delete
