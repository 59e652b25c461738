"""LocalNetwork: a broker (or several replicas of it) and agents as real processes on
loopback.

Used by `sparecycles demo`, the end-to-end tests and the benchmarks. It drives the same
`sparecycles` commands a person would type (through ``python -m sdk.cli``), so it needs no
import of the broker or the agent.

With ``tls=True`` it makes a dev CA and a server certificate first (`sparecycles broker
dev-cert`), serves REST and gRPC over TLS with them, and gives every agent and the
processes it starts the CA (``ca_file`` in agent.toml, ``SPARECYCLES_CA_BUNDLE``); a
client in the caller's process trusts it with ``Client(net.url, key, ca_file=net.ca_file)``
or that variable.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import urllib3


class LocalNetworkError(RuntimeError):
    pass


def cli(*args: str) -> list[str]:
    # -P: never put the working directory on sys.path (a folder there could shadow a package)
    return [sys.executable, "-P", "-m", "sdk.cli", *args]


@dataclass
class AgentProcess:
    name: str
    home: Path
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)


class LocalNetwork:
    def __init__(self, workdir: Path, *, db_url: str | None = None, lease_timeout_s: float = 30,
                 env: dict | None = None, tls: bool = False):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db_url = db_url
        self.lease_timeout_s = lease_timeout_s
        self.tls = tls
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        # Benchmarks drive the broker from one key far past any per-key budget: no rate
        # limits here unless the caller sets them (broker/ratelimit.py).
        self.env.setdefault("SPARECYCLES_RATE_LIMITS", "off")
        self.ca_file: Path | None = None
        if tls:
            self._make_cert()
            self.env["SPARECYCLES_CA_BUNDLE"] = str(self.ca_file)
        self._http = urllib3.PoolManager(
            ca_certs=str(self.ca_file) if self.ca_file else None)
        self.broker: subprocess.Popen | None = None
        self.info: dict = {}
        self.agents: list[AgentProcess] = []
        self.replicas: list[tuple[subprocess.Popen, dict]] = []  # beyond the first broker
        self._logs: list = []

    # ---- broker ----------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return self.workdir / "broker-data"

    def _broker_args(self) -> list[str]:
        args = ["--data-dir", str(self.data_dir)]
        if self.db_url:
            args += ["--db", self.db_url]
        return args

    @property
    def tls_dir(self) -> Path:
        return self.data_dir / "tls"

    def _make_cert(self) -> None:
        out = subprocess.run(cli("broker", "dev-cert", "--data-dir", str(self.data_dir),
                                 "--host", "127.0.0.1", "--host", "localhost",
                                 "--host", "::1"),
                             capture_output=True, text=True, env=self.env, cwd=self.workdir)
        if out.returncode != 0:
            raise LocalNetworkError(f"broker dev-cert failed: {out.stderr.strip()}")
        self.ca_file = self.tls_dir / "ca.pem"

    def start_broker(self, http: str = "127.0.0.1:0", grpc: str = "127.0.0.1:0",
                     timeout_s: float = 60) -> dict:
        if self.db_url and self.db_url.startswith("postgresql"):
            # `serve` refuses a PostgreSQL database that is behind: migrate first, as an
            # operator does once per release (idempotent, under an advisory lock).
            log = open(self.workdir / "broker.log", "ab")
            self._logs.append(log)
            subprocess.run(cli("broker", "migrate", *self._broker_args()), stdout=log,
                           stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                           check=True, timeout=timeout_s)
        self.broker, self.info = self._serve("broker", http, grpc, timeout_s)
        return self.info

    def start_replica(self, http: str = "127.0.0.1:0", grpc: str = "127.0.0.1:0",
                      timeout_s: float = 60) -> dict:
        """Another broker process on the same PostgreSQL database, data dir and key (a
        replica: docs/architecture.md, *Replicas*); returns its addresses. Start the first
        with :meth:`start_broker`. Its process is ``self.replicas[i][0]``."""
        return self.start_replicas(1, timeout_s=timeout_s)[0]

    def start_replicas(self, n: int, timeout_s: float = 60) -> list[dict]:
        """``n`` replicas at once (on ephemeral ports): started together, waited for
        together."""
        if not (self.db_url or "").startswith("postgresql"):
            raise LocalNetworkError("replicas need PostgreSQL (db_url=postgresql+psycopg://…); "
                                    "SQLite serves one broker process")
        if self.broker is None:
            raise LocalNetworkError("start the first broker (start_broker) before a replica")
        first = len(self.replicas) + 1
        launched = [self._launch(f"broker-{first + i}", "127.0.0.1:0", "127.0.0.1:0")
                    for i in range(n)]
        out = []
        for name, proc, ready in launched:
            info = self._await(name, proc, ready, timeout_s)
            self.replicas.append((proc, info))
            out.append(info)
        return out

    def _serve(self, name: str, http: str, grpc: str,
               timeout_s: float) -> tuple[subprocess.Popen, dict]:
        name, proc, ready = self._launch(name, http, grpc)
        return proc, self._await(name, proc, ready, timeout_s)

    def _launch(self, name: str, http: str, grpc: str) -> tuple[str, subprocess.Popen, Path]:
        ready = self.workdir / f"{name}-ready.json"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / f"{name}.log", "ab")
        self._logs.append(log)
        tls = (["--tls-cert", str(self.tls_dir / "server.pem"),
                "--tls-key", str(self.tls_dir / "server.key")] if self.tls else [])
        proc = subprocess.Popen(
            cli("broker", "serve", *self._broker_args(), "--http", http, "--grpc", grpc,
                "--lease-timeout", str(self.lease_timeout_s), "--ready-file", str(ready),
                *tls),
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir)
        return name, proc, ready

    def _await(self, name: str, proc: subprocess.Popen, ready: Path, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise LocalNetworkError(f"the broker exited (code {proc.returncode}); "
                                        f"see {self.workdir / (name + '.log')}:\n"
                                        f"{self.tail(name + '.log')}")
            if time.monotonic() > deadline:
                raise LocalNetworkError(f"the broker did not start within {timeout_s:g}s; see "
                                        f"{self.workdir / (name + '.log')}")
            time.sleep(0.05)
        return json.loads(ready.read_text())

    def restart_broker(self, hard: bool = True) -> dict:
        """Kill the broker (SIGKILL when ``hard``) and start it again on the same ports."""
        if self.broker and self.broker.poll() is None:
            self.broker.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            self.broker.wait(30)
        http = self.info["http"].split("://", 1)[1]
        return self.start_broker(http=http, grpc=self.info["grpc"])

    @property
    def url(self) -> str:
        return self.info["http"]

    def client(self, api_key: str, **kwargs):
        """An SDK client of this network's broker (trusting its dev CA when on TLS)."""
        from sdk.client import Client

        return Client(self.url, api_key, ca_file=str(self.ca_file) if self.ca_file else None,
                      **kwargs)

    def create_key(self, role: str, name: str = "", *, credits: str | None = "1000") -> str:
        """A new account's API key; a client account is granted ``credits`` (dev funding)."""
        grant = ["--credits", credits] if credits and role == "client" else []
        out = subprocess.run(cli("broker", "create-key", *self._broker_args(), "--role", role,
                                 "--name", name or role, *grant),
                             capture_output=True, text=True, env=self.env, cwd=self.workdir)
        if out.returncode != 0:
            raise LocalNetworkError(f"create-key failed: {out.stderr.strip()}")
        return out.stdout.strip().splitlines()[-1]

    # ---- agents ----------------------------------------------------------------------
    def start_agent(self, name: str, api_key: str, *, plugins: str = "echo", slots: int = 1,
                    weights_dir: Path | None = None, sandbox: bool = True,
                    extra_env: dict | None = None, device: str = "cpu",
                    run_args: list[str] | None = None, env: dict | None = None,
                    broker: str | None = None) -> AgentProcess:
        """Start ``sparecycles agent run`` (after ``agent init`` the first time); extra
        ``run_args`` go to `agent run` (e.g. ["--ask", "echo=200"]); ``env`` (or its older
        name ``extra_env``) is merged into the agent process's environment, e.g.
        ``{"OMP_NUM_THREADS": "2"}``. ``broker``:
        the agent address(es) to give it (default the first broker's; replicas'
        as "HOST:PORT,HOST:PORT")."""
        home = self.workdir / f"agent-{name}"
        if not (home / "agent.toml").exists():
            init = cli("agent", "init", "--home", str(home), "--broker",
                       broker or self.info["grpc"],
                       "--api-key", api_key, "--name", name, "--plugins", plugins,
                       "--slots", str(slots))
            if weights_dir:
                init += ["--weights-dir", str(weights_dir)]
            if self.ca_file:
                init += ["--ca-file", str(self.ca_file)]
            out = subprocess.run(init, capture_output=True, text=True, env=self.env)
            if out.returncode != 0:
                raise LocalNetworkError(f"agent init failed: {out.stderr.strip()}")
        args = cli("agent", "run", "--home", str(home), "--device", device, *(run_args or []))
        if not sandbox:
            args.append("--no-sandbox")
        log_path = self.workdir / f"agent-{name}.log"
        log = open(log_path, "ab")
        self._logs.append(log)
        # Several agents share this machine's cores: one torch thread each avoids
        # oversubscription (an operator's single agent keeps torch's default).
        env = {"OMP_NUM_THREADS": "1", **self.env, **(extra_env or {}), **(env or {})}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=self.workdir)
        agent = AgentProcess(name, home, proc, log_path, args, env)
        self.agents.append(agent)
        return agent

    def restart_agent(self, agent: AgentProcess) -> AgentProcess:
        log = open(agent.log_path, "ab")
        self._logs.append(log)
        agent.proc = subprocess.Popen(agent.args, stdout=log, stderr=subprocess.STDOUT,
                                      env=agent.env, cwd=self.workdir)
        return agent

    def wait_for_providers(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for a in self.agents:
                if a.proc.poll() is not None:
                    raise LocalNetworkError(f"agent {a.name} exited (code {a.proc.returncode}):\n"
                                            f"{self.tail(a.log_path.name)}")
            online = 0  # each replica counts the agents connected to it
            for url in [self.url] + [info["http"] for proc, info in self.replicas
                                     if proc.poll() is None]:
                try:
                    resp = self._http.request("GET", f"{url}/readyz", timeout=5,
                                              retries=False)
                    body = json.loads(resp.data)
                    if isinstance(body, dict):
                        online += int(body.get("providers_online", 0))
                except (urllib3.exceptions.HTTPError, ValueError):
                    pass
            if online >= n:
                return
            time.sleep(0.1)
        raise LocalNetworkError(f"{n} agent(s) did not connect within {timeout_s:g}s")

    def tail(self, log_name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.workdir / log_name).read_text(errors="replace")
                             .splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    # ---- shutdown --------------------------------------------------------------------
    def stop(self, timeout_s: float = 30) -> None:
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        for a in self.agents:
            try:
                a.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                a.proc.kill()
                a.proc.wait()
        brokers = [p for p in [self.broker] + [p for p, _ in self.replicas]
                   if p is not None and p.poll() is None]
        for proc in brokers:
            proc.send_signal(signal.SIGTERM)
        for proc in brokers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
