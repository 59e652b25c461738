"""The agent's Installer against the broker's real REST app (in-process WSGI): signature and
sha256 checks before use, atomic installs that leave nothing behind, the LRU size cap."""
import json
import queue
import threading
import time
from pathlib import Path

import httpx
import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings
from plugins import builtin_plugin_dir
from provider_agent.agent import Agent, RunningJob
from provider_agent.config import AgentConfig
from provider_agent.installer import Installer, InstallError, resolve_plugins
from sdk.protocol.package import build_document, sign_document
from sdk.protocol.signing import KeyPair

from tests.marketplace_helpers import adapter_folder, plugin_folder, publish, register


class Tamper(httpx.BaseTransport):
    """Passes requests to the broker app; ``edit(path, json)`` may rewrite JSON answers.
    ``downloads`` lists the file paths requested (``…/files/…``)."""

    def __init__(self, inner, edit=None):
        self.inner, self.edit = inner, edit
        self.downloads: list[str] = []

    def handle_request(self, request):
        if "/files/" in request.url.path:
            self.downloads.append(request.url.path)
        resp = self.inner.handle_request(request)
        if self.edit is None or "/files/" in request.url.path or resp.status_code != 200:
            return resp
        resp.read()
        body = self.edit(request.url.path, json.loads(resp.content))
        return httpx.Response(200, json=body)


@pytest.fixture
def world(tmp_path):
    settings = Settings(data_dir=tmp_path / "broker", maintenance_interval_s=0)
    services = build_services(settings)
    app = create_app(services)
    _, pub = services.auth.create_account_with_key("publisher")
    provider_key, _ = services.auth.create_account_with_key("provider")
    keys = register(services.registry, pub)
    w = type("World", (), {})()
    w.services, w.pub, w.keys, w.tmp = services, pub, keys, tmp_path
    w.wsgi = httpx.WSGITransport(app=app)

    def installer(edit=None, **kw):
        tamper = Tamper(w.wsgi, edit)
        http = httpx.Client(transport=tamper, base_url="http://broker",
                            headers={"Authorization": f"Bearer {provider_key}"})
        inst = Installer(None, None, tmp_path / "cache", http=http, **kw)
        inst.tamper = tamper  # the test's handle on what it was asked
        return inst

    w.installer = installer
    w.downloads = lambda inst: inst.tamper.downloads

    w.publish = lambda folder, **kw: publish(services.registry, pub, keys, folder, **kw)
    yield w
    services.close()


def _sd15_agent(world, inst):
    """An unsandboxed agent serving sd15 (weights in a fresh folder) with ``inst``, its
    messages to the broker kept in ``agent._outq``; returns (agent, the weights folder)."""
    weights = world.tmp / "w" / "sd15"
    weights.mkdir(parents=True)
    cfg = AgentConfig(api_key="k", plugins=["sd15"], weights={"sd15": str(weights)}, device="cpu")
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"sd15": builtin_plugin_dir("sd15")},
                  sandboxed=False, installer=inst)
    agent._outq = queue.Queue()
    return agent, weights


def _two_adapters_and_room_for_one(world):
    """Publishes adapters a1 and a2 of the same size; an installer whose cache fits one."""
    for name in ("a1", "a2"):
        world.publish(adapter_folder(world.tmp, name=name, payload=b"x" * 4000 + name.encode()))
    one = sum(f["size"] for f in world.services.registry.get("adapter", "a1").document["files"])
    return world.installer(max_bytes=one + 10)


def _clean(cache: Path) -> None:
    """Nothing half-installed: no temporary downloads, no package folders, empty index."""
    assert list((cache / ".tmp").iterdir()) == []
    assert not any(cache.glob("adapters/*/*")) and not any(cache.glob("plugins/*"))
    assert json.loads((cache / "index.json").read_text())["entries"] == {}


def test_installs_a_signed_adapter_and_links_it_for_the_plugin_host(world):
    folder = adapter_folder(world.tmp, name="ink", royalty=100)
    world.publish(folder)
    inst = world.installer()
    got = inst.install_adapter("ink", base="sd15")
    assert got.path == inst.root / "adapters" / "sd15" / "ink@1.0.0"
    assert (got.path / "pytorch_lora_weights.safetensors").read_bytes() == \
        (folder / "pytorch_lora_weights.safetensors").read_bytes()
    assert inst.installed_adapters() == [{"plugin": "sd15", "name": "ink", "version": "1.0.0",
                                          "digest": got.digest}]
    # Readable to the unprivileged user a root agent's plugin hosts run as.
    assert all(p.stat().st_mode & (0o005 if p.is_dir() else 0o004)
               for p in [got.path, *got.path.rglob("*")])
    link = inst.link_adapter(got, world.tmp / "weights" / "sd15" / "adapters")
    assert link.is_symlink() and (link / "adapter.json").is_file()
    assert inst.verify_installed(got.key).digest == got.digest
    # installed again: served from the cache, same folder
    assert inst.install_adapter("ink", base="sd15").path == got.path


def test_a_tampered_file_is_refused_and_leaves_nothing(world):
    folder = adapter_folder(world.tmp, name="ink")
    world.publish(folder)
    blob = folder / "pytorch_lora_weights.safetensors"
    sha = json.loads(json.dumps(build_document(folder, world.keys.public_key_hex)))["files"]
    sha = next(f["sha256"] for f in sha if f["path"] == blob.name)
    stored = world.services.settings.blob_dir / "registry" / sha[:2] / sha[2:4] / sha
    stored.write_bytes(b"\0" * stored.stat().st_size)  # the broker's copy is damaged
    inst = world.installer()
    with pytest.raises(InstallError) as e:
        inst.install_adapter("ink", base="sd15")
    assert e.value.code == "sha256_mismatch" and blob.name in str(e.value)
    _clean(inst.root)


def test_unsigned_and_wrongly_signed_packages_are_refused_before_download(world):
    world.publish(adapter_folder(world.tmp, name="ink"))
    unsigned = world.installer(edit=lambda path, body: {**body, "signature": ""})
    with pytest.raises(InstallError) as e:
        unsigned.install_adapter("ink", base="sd15")
    assert e.value.code == "unsigned" and world.downloads(unsigned) == []
    _clean(unsigned.root)
    other = KeyPair.generate()
    forged = world.installer(edit=lambda path, body: {
        **body, "signature": other.sign("adapter", body["document"])})
    with pytest.raises(InstallError) as e:
        forged.install_adapter("ink", base="sd15")
    assert e.value.code == "bad_signature" and world.downloads(forged) == []
    raised = world.installer(edit=lambda path, body: {
        **body, "document": {**body["document"], "royalty_micro": 1}})
    with pytest.raises(InstallError) as e:  # the document was changed after signing
        raised.install_adapter("ink", base="sd15")
    assert e.value.code == "bad_signature" and world.downloads(raised) == []
    _clean(raised.root)
    honest = world.installer()  # the recording sees a download when there is one
    honest.install_adapter("ink", base="sd15")
    assert world.downloads(honest) and all("/v1/adapters/ink/1.0.0/files/" in p
                                           for p in world.downloads(honest))


def test_an_adapter_for_another_base_is_refused(world):
    world.publish(adapter_folder(world.tmp, name="ink", base="sd15"))
    inst = world.installer()
    with pytest.raises(InstallError) as e:
        inst.install_adapter("ink", base="sdxl")
    assert e.value.code == "base_mismatch" and "for sd15, not for sdxl" in str(e.value)
    _clean(inst.root)


def test_a_new_publisher_key_for_a_pinned_name_is_refused(world):
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    inst.install_adapter("ink", base="sd15")
    mallory = KeyPair.generate()
    folder = adapter_folder(world.tmp, name="ink", version="1.0.0")

    def swap(path, body):
        doc = build_document(folder, mallory.public_key_hex)
        return {**body, "document": doc, "signature": sign_document(mallory, doc)}
    inst2 = world.installer(edit=swap)
    with pytest.raises(InstallError) as e:
        inst2.install_adapter("ink", base="sd15")
    assert e.value.code == "publisher_changed"
    trusted = world.installer(trusted_keys={"ab" * 32})
    inst.evict("adapter:sd15/ink@1.0.0")
    with pytest.raises(InstallError) as e:
        trusted.install_adapter("ink", base="sd15")
    assert e.value.code == "untrusted_publisher"


def test_the_cache_cap_evicts_the_least_recently_used(world):
    for name in ("a1", "a2", "a3"):
        world.publish(adapter_folder(world.tmp, name=name, payload=b"x" * 4000 + name.encode()))
    size = world.services.registry.get("adapter", "a1").document["files"]
    one = sum(f["size"] for f in size)
    clock = iter(range(100, 200)).__next__
    inst = world.installer(max_bytes=2 * one + 10, clock=clock)
    inst.install_adapter("a1", base="sd15")
    inst.install_adapter("a2", base="sd15")
    inst.touch("adapter:sd15/a1@1.0.0")            # a1 used after a2: a2 is now the LRU
    inst.install_adapter("a3", base="sd15")
    assert sorted(inst.entries()) == ["adapter:sd15/a1@1.0.0", "adapter:sd15/a3@1.0.0"]
    assert not (inst.root / "adapters" / "sd15" / "a2@1.0.0").exists()
    assert inst.used_bytes() <= inst.max_bytes
    inst.in_use.update(inst.entries())             # nothing may go: the next one cannot fit
    with pytest.raises(InstallError) as e:
        inst.install_adapter("a2", base="sd15")
    assert e.value.code == "cache_full"
    assert list((inst.root / ".tmp").iterdir()) == []


def test_a_package_damaged_on_disk_is_evicted_before_use(world):
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    got = inst.install_adapter("ink", base="sd15")
    (got.path / "pytorch_lora_weights.safetensors").write_bytes(b"evil")
    with pytest.raises(InstallError) as e:
        inst.verify_installed(got.key)
    assert e.value.code == "tampered" and not got.path.exists()
    assert inst.entries() == {}


def test_the_agent_serves_what_it_can_when_one_install_fails(world, caplog):
    world.publish(plugin_folder(world.tmp, name="reverse"))
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    weights = world.tmp / "weights"
    (weights / "sd15").mkdir(parents=True)
    cfg = AgentConfig(api_key="k", plugins=["echo", "reverse", "nosuch", "sd15"],
                      weights_dir=str(weights), adapters={"sd15": ["ink", "missing"]})
    dirs = resolve_plugins(cfg, inst)
    assert sorted(dirs) == ["echo", "reverse", "sd15"] and cfg.plugins == list(dirs)
    assert dirs["reverse"] == inst.root / "plugins" / "reverse@1.0.0"
    assert (dirs["reverse"] / "plugin.toml").is_file()
    assert (weights / "sd15" / "adapters" / "ink" / "adapter.json").is_file()
    assert "not serving nosuch" in caplog.text and "adapter missing for sd15" in caplog.text
    # a restart finds the cache as it was left, with nothing stray
    again = world.installer()
    assert sorted(again.entries()) == sorted(inst.entries())


def test_the_agent_fetches_a_jobs_missing_adapter_before_running_it(world):
    world.publish(adapter_folder(world.tmp, name="ink"))
    world.publish(adapter_folder(world.tmp, name="xl", base="sdxl"))
    agent, weights = _sd15_agent(world, world.installer())
    env = {"job_id": "j1", "attempt": 1, "plugin": "sd15",
           "inputs": {"prompt": "x", "adapters": "ink:0.5,someones-own"}}
    rj = RunningJob(env, b"")
    assert agent._prepare_job("j1", rj) is True
    assert (weights / "adapters" / "ink" / "adapter.json").is_file()
    assert rj.held == ["adapter:sd15/ink@1.0.0"]  # kept from eviction while it runs
    sent = agent._outq.get_nowait()
    assert sent.WhichOneof("body") == "inventory"
    assert [(a.plugin, a.name) for a in sent.inventory.adapters] == [("sd15", "ink")]
    assert [a.name for a in agent._capabilities().adapters] == ["ink"]
    # the next job finds it linked: held too, and no inventory (nothing changed)
    again = RunningJob({**env, "job_id": "j3"}, b"")
    assert agent._prepare_job("j3", again) is True and again.held == rj.held
    assert agent._outq.empty()
    # an adapter for another base fails only this job (retryable), with a clear code
    env2 = {**env, "job_id": "j2", "inputs": {"prompt": "x", "adapters": "xl"}}
    assert agent._prepare_job("j2", RunningJob(env2, b"")) is False
    failed = agent._outq.get_nowait().failed
    assert (failed.job_id, failed.code, failed.retryable) == ("j2", "adapter_base_mismatch", True)
    assert not (weights / "adapters" / "xl").exists()


# ---- regressions from the marketplace review --------------------------------------------
def test_an_unexpected_error_mid_install_is_an_install_error_and_leaves_nothing(world,
                                                                               monkeypatch):
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()

    def clash(tmp, final):
        raise FileExistsError(17, "File exists", str(final))
    monkeypatch.setattr(inst, "_move_into_place", clash)
    with pytest.raises(InstallError) as e:
        inst.install_adapter("ink", base="sd15")
    assert e.value.code == "invalid_package" and "FileExistsError" in str(e.value)
    _clean(inst.root)


def test_a_full_disk_after_the_rename_removes_the_installed_folder(world, monkeypatch):
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()

    def full():
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(inst, "_save_index", full)
    with pytest.raises(InstallError) as e:
        inst.install_adapter("ink", base="sd15")
    assert e.value.code == "invalid_package" and "No space left" in str(e.value)
    assert inst.entries() == {} and inst._index["pins"] == {}
    monkeypatch.undo()
    _clean(inst.root)
    assert inst.install_adapter("ink", base="sd15").path.is_dir()  # and it can be retried


def test_a_registry_answer_of_the_wrong_shape_or_signature_length_is_refused(world):
    world.publish(adapter_folder(world.tmp, name="ink"))
    listed = world.installer(edit=lambda path, body: [body])
    with pytest.raises(InstallError) as e:
        listed.install_adapter("ink", base="sd15")
    assert e.value.code == "invalid_package" and "not an object" in str(e.value)
    short = world.installer(edit=lambda path, body: {**body, "signature": "abcd"})
    with pytest.raises(InstallError) as e:
        short.install_adapter("ink", base="sd15")
    assert e.value.code == "bad_signature"
    _clean(short.root)


def test_the_agent_serves_its_other_plugins_when_one_fails_unexpectedly(world, monkeypatch,
                                                                         caplog):
    world.publish(plugin_folder(world.tmp, name="reverse"))
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    inst.install_plugin("reverse")  # cached: resolve_plugins re-verifies it
    weights = world.tmp / "weights"
    (weights / "sd15").mkdir(parents=True)
    real_verify = inst.verify_installed

    def broken(key):
        if key.startswith("plugin:reverse"):
            raise RuntimeError("disk went away")
        return real_verify(key)
    monkeypatch.setattr(inst, "verify_installed", broken)
    monkeypatch.setattr(inst, "link_adapter", lambda *a: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    cfg = AgentConfig(api_key="k", plugins=["reverse", "echo", "sd15"],
                      weights_dir=str(weights), adapters={"sd15": ["ink"]})
    dirs = resolve_plugins(cfg, inst)
    assert sorted(dirs) == ["echo", "sd15"]
    assert "not serving reverse" in caplog.text and "disk went away" in caplog.text
    assert "adapter ink for sd15 not installed" in caplog.text


def test_an_eviction_is_reported_even_when_the_install_then_fails(world):
    inst = _two_adapters_and_room_for_one(world)
    inst.install_adapter("a1", base="sd15")
    sha = next(f["sha256"] for f in world.services.registry.get("adapter", "a2").document["files"]
               if f["path"].endswith(".safetensors"))
    stored = world.services.registry.blobs.path(sha)
    stored.write_bytes(b"\0" * stored.stat().st_size)  # a2's download will fail its sha256
    agent, _ = _sd15_agent(world, inst)
    env = {"job_id": "j1", "attempt": 1, "plugin": "sd15", "inputs": {"adapters": "a2"}}
    assert agent._prepare_job("j1", RunningJob(env, b"")) is False
    assert agent._outq.get_nowait().failed.code == "adapter_sha256_mismatch"
    sent = agent._outq.get_nowait()  # a1 was evicted to make room: the broker hears of it
    assert sent.WhichOneof("body") == "inventory" and list(sent.inventory.adapters) == []
    assert inst.entries() == {}


# ---- the lock, the index writes, held adapters, re-hashing (installer review) -------------
def test_a_slow_download_stalls_neither_the_index_nor_a_second_install_of_it(world,
                                                                           monkeypatch):
    world.publish(adapter_folder(world.tmp, name="ink"))
    world.publish(adapter_folder(world.tmp, name="other"))
    inst = world.installer()
    other = inst.install_adapter("other", base="sd15")
    started, go = threading.Event(), threading.Event()
    real = inst._download

    def slow(*args):
        started.set()
        assert go.wait(10)
        real(*args)
    monkeypatch.setattr(inst, "_download", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(inst.install_adapter("ink",
                                                                            base="sd15")))
               for _ in range(2)]
    threads[0].start()
    assert started.wait(10)
    threads[1].start()
    t0 = time.monotonic()  # while ink downloads, another slot's job gets its answers at once
    assert sorted(inst.entries()) == [other.key]
    assert [a["name"] for a in inst.installed_adapters()] == ["other"]
    assert inst.touch_path(other.path, hold=True) == other.key
    inst.release([other.key])
    assert time.monotonic() - t0 < 5  # (the download it must not wait for takes 10 s)
    go.set()
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0].path == got[1].path and got[0].path.is_dir()
    assert sorted(g.fresh for g in got) == [False, True]  # downloaded once, then found
    ink_files = [p for p in world.downloads(inst) if "/adapters/ink/" in p]
    assert len(ink_files) == len(got[0].package.files)
    assert sorted(inst.entries()) == sorted([other.key, got[0].key])
    assert list((inst.root / ".tmp").iterdir()) == []
    inst.verify_installed(other.key)
    assert inst._gates == {}  # a package's turn-taking lock goes when no one uses it


def test_last_use_is_kept_in_memory_and_written_on_install_eviction_and_flush(world,
                                                                            monkeypatch):
    import provider_agent.installer as installer_mod

    world.publish(adapter_folder(world.tmp, name="ink"))
    world.publish(adapter_folder(world.tmp, name="other"))
    inst = world.installer(clock=iter(range(100, 200)).__next__)
    got = inst.install_adapter("ink", base="sd15")
    assert got.fresh and inst.changes == 1

    def on_disk():
        return json.loads((inst.root / "index.json").read_text())["entries"][got.key][
            "last_used"]
    written = on_disk()
    assert inst.touch_path(got.path) == got.key
    assert inst.install_adapter("ink", base="sd15").fresh is False
    assert inst.changes == 1                            # a cache hit changes nothing
    assert inst.entries()[got.key]["last_used"] > written and on_disk() == written
    inst.install_adapter("other", base="sd15")           # an install writes the index
    assert on_disk() == inst.entries()[got.key]["last_used"] and inst.changes == 2
    inst.touch(got.key)
    inst.flush()                                         # (the agent's stop)
    assert on_disk() == inst.entries()[got.key]["last_used"]
    monkeypatch.setattr(installer_mod, "SAVE_EVERY_S", 0.0)
    inst.touch(got.key)                                  # the periodic write
    assert on_disk() == inst.entries()[got.key]["last_used"]
    assert inst.evict(got.key) is True and inst.changes == 3
    assert inst.evict(got.key) is False and inst.changes == 3


def test_an_adapter_a_running_job_holds_is_not_evicted(world, monkeypatch):
    inst = _two_adapters_and_room_for_one(world)
    agent, weights = _sd15_agent(world, inst)
    seen = []

    def run(job_id, rj):
        seen.append(list(rj.held))
        try:  # another slot's job needs a2 meanwhile: a1 must stay
            inst.install_adapter("a2", base="sd15")
        except InstallError as exc:
            seen.append(exc.code)
    monkeypatch.setattr(agent, "_run_job", run)
    worker = threading.Thread(target=agent._worker, daemon=True)
    worker.start()
    env = {"job_id": "j1", "attempt": 1, "plugin": "sd15", "inputs": {"adapters": "a1"}}
    with agent._lock:
        agent.running["j1"] = RunningJob(env, b"")
    agent.jobs.put("j1")
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    agent._stop.set()
    agent.jobs.put(None)
    worker.join(5)
    assert seen == [["adapter:sd15/a1@1.0.0"], "cache_full"]
    assert (weights / "adapters" / "a1" / "adapter.json").is_file()
    # the job is over: a1 may go now
    inst.install_adapter("a2", base="sd15")
    assert sorted(inst.entries()) == ["adapter:sd15/a2@1.0.0"]


def test_a_fresh_install_is_not_hashed_again_at_start_but_a_cached_one_is(world, monkeypatch):
    world.publish(plugin_folder(world.tmp, name="reverse"))
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    weights = world.tmp / "weights"
    (weights / "sd15").mkdir(parents=True)
    verified = []
    real_verify = inst.verify_installed

    def verify(key):
        verified.append(key)
        return real_verify(key)
    monkeypatch.setattr(inst, "verify_installed", verify)

    def cfg():
        return AgentConfig(api_key="k", plugins=["reverse", "sd15"], weights_dir=str(weights),
                           adapters={"sd15": ["ink"]})
    assert sorted(resolve_plugins(cfg(), inst)) == ["reverse", "sd15"]
    assert verified == []                       # just downloaded and hashed on the way in
    assert sorted(resolve_plugins(cfg(), inst)) == ["reverse", "sd15"]
    assert verified == ["plugin:reverse@1.0.0", "adapter:sd15/ink@1.0.0"]


def test_an_evicted_packages_files_are_deleted_without_the_lock(world, monkeypatch):
    import provider_agent.installer as installer_mod

    inst = _two_adapters_and_room_for_one(world)
    real_rmtree = installer_mod.shutil.rmtree
    lock_free = []

    def try_lock():
        got = inst._lock.acquire(timeout=0.5)
        if got:
            inst._lock.release()
        lock_free.append(got)

    def rmtree(path, *args, **kw):
        if Path(path).name.startswith("evict-"):  # another thread may take the lock
            t = threading.Thread(target=try_lock)
            t.start()
            t.join()
        real_rmtree(path, *args, **kw)
    monkeypatch.setattr(installer_mod.shutil, "rmtree", rmtree)
    a1 = inst.install_adapter("a1", base="sd15")
    a2 = inst.install_adapter("a2", base="sd15")   # a1 is evicted to make room
    assert sorted(inst.entries()) == [a2.key] and not a1.path.exists()
    assert inst.evict(a2.key) is True and not a2.path.exists()
    assert lock_free == [True, True]
    assert list((inst.root / ".tmp").iterdir()) == []
    assert json.loads((inst.root / "index.json").read_text())["entries"] == {}


def test_close_logs_a_failed_index_write_and_still_closes_the_registry_client(world,
                                                                            monkeypatch,
                                                                            caplog):
    world.publish(adapter_folder(world.tmp, name="ink"))
    inst = world.installer()
    got = inst.install_adapter("ink", base="sd15")
    inst.touch(got.key)  # a last-use time only in memory

    def full():
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(inst, "_save_index", full)
    inst.close()
    assert "could not save the package cache's last-use times" in caplog.text
    assert inst.http.is_closed
