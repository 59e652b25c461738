"""Sealed prompts: jobs run end to end (a primary and its verification re-run on another
operator), then the database file, the blob folder and every log line are scanned for the
prompts: none is there in plaintext. An envelope opens only with the identity of the
provider it is addressed to."""
from __future__ import annotations

import logging
import uuid

import pytest

from sdk import Client
from sdk.protocol.envelope import EnvelopeError, ReplayGuard, open_envelope
from sdk.protocol.sealing import SealingError, open_inputs
from sdk.protocol.canonical import canonical_bytes

from tests.integration.conftest import LiveBroker, agent_starter
from broker.api.job_request import job_request


@pytest.fixture
def vbroker(tmp_path):
    b = LiveBroker(tmp_path, verification=True, check_delay_max_s=0.0)
    yield b
    b.stop()


@pytest.fixture
def agents(vbroker):
    start, stop_all = agent_starter(vbroker)
    yield start
    stop_all()


def _files(root):
    return [p for p in root.rglob("*") if p.is_file()]


def test_no_prompt_is_stored_or_logged_in_plaintext(vbroker, agents, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    svc = vbroker.services
    agents("first")
    client = Client(vbroker.url, vbroker.key("client"))
    prompts = [f"secret-prompt-{uuid.uuid4().hex}" for _ in range(3)]
    results = [client.generate("echo", text=p, timeout=30) for p in prompts]
    agents("second")  # the checker of the new provider's jobs
    for r in results:
        assert r.wait_verified(timeout=30) == "verified"
        assert r.json[0]["text"] in prompts  # the client reads its output back
    # A job streamed with progress events, cancelled midway: events and the cancel too.
    slow = client.jobs.create("echo", text=prompts[1], sleep_ms=400, steps=4)
    slow.cancel()
    assert svc.jobs.repo.checks_of(results[0].job.id), "a verification re-run happened"

    svc.engine.dispose()  # (SQLite: nothing left only in a connection's cache)
    files = _files(vbroker.settings.data_dir)
    assert any(p.name.startswith("broker.db") for p in files)
    assert any("blobs" in p.parts for p in files)
    assert any(b"$sealed" in p.read_bytes() for p in files if p.name.startswith("broker.db"))
    for path in files:
        data = path.read_bytes()
        for p in prompts:
            assert p.encode() not in data, f"{p} in plaintext in {path}"
    for p in prompts:
        assert p not in caplog.text, f"{p} in the logs"
    # What the broker reads back is the plaintext (for the client, the checker's envelope).
    primary = svc.jobs.repo.get(results[0].job.id)
    assert primary.inputs["text"] in prompts


def test_an_envelope_opens_only_for_its_provider(vbroker, agents):
    svc = vbroker.services
    first = agents("first")
    second = agents("second")
    client = Client(vbroker.url, vbroker.key("client"))
    result = client.generate("echo", text="for one provider only", timeout=30)
    job = svc.jobs.repo.get(result.job.id)
    mine, other = ((first, second) if job.provider_id == first.provider_id
                   else (second, first))
    sealed = job.envelope["sealed_inputs"]
    assert "for one provider only" not in canonical_bytes(job.envelope).decode()
    assert open_inputs(sealed, mine.identity)["text"] == "for one provider only"
    with pytest.raises(SealingError, match="not sealed to this provider"):
        open_inputs(sealed, other.identity)
    # The whole envelope, handed to the other agent (as if misdelivered or copied):
    # refused before anything runs, whether by address or by the seal.
    data = canonical_bytes(job.envelope)
    signature = svc.signer.sign_canonical("envelope", data)
    with pytest.raises(EnvelopeError) as refused:
        open_envelope(data, signature, broker_key=svc.signer.public_key_hex,
                      my_key=other.identity.public_key_hex, replay=ReplayGuard(),
                      now=job.envelope["issued_at_ms"] / 1000, identity=other.identity)
    assert refused.value.code == "wrong_provider"
    forged = {**job.envelope, "provider": other.identity.public_key_hex}
    data = canonical_bytes(forged)
    with pytest.raises(EnvelopeError) as refused:
        open_envelope(data, svc.signer.sign_canonical("envelope", data),
                      broker_key=svc.signer.public_key_hex,
                      my_key=other.identity.public_key_hex, replay=ReplayGuard(),
                      now=job.envelope["issued_at_ms"] / 1000, identity=other.identity)
    assert refused.value.code == "unsealable_inputs"


def test_plaintext_stored_before_sealing_is_sealed_by_the_command(tmp_path, capsys):
    """Rows and blobs a broker wrote before it sealed at rest keep working, and
    `sparecycles broker seal-at-rest` seals them."""
    from sqlalchemy import update

    from broker.services import build_services
    from broker.settings import Settings
    from broker.storage.base import make_engine
    from broker.storage.models import JobEventRow, JobRow
    from sdk.cli import main
    from tests.integration.conftest import seen_provider

    settings = Settings(data_dir=tmp_path / "b", verification=False)
    svc = build_services(settings)
    seen_provider(svc, ["echo"])
    key, who = svc.auth.create_account_with_key("client")
    svc.payments.grant(who.account_id, 10**7, by="test")
    job, _ = svc.jobs.submit(who, job_request({"plugin": "echo", "inputs": {"text": "x"}}, svc.jobs.catalog))
    old = f"old-secret-{uuid.uuid4().hex}"
    bare = make_engine(settings.db_url)  # no at-rest key: writes plaintext, as before
    with bare.begin() as c:
        c.execute(update(JobRow.__table__).where(JobRow.__table__.c.id == job.id)
                  .values(inputs={"text": old}, error_message=old))
        c.execute(update(JobEventRow.__table__).values(data={"note": old}))
    bare.dispose()
    blob = svc.jobs.blobs.root / "ab" / "cd" / ("abcd" + "0" * 60)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(old.encode())
    assert svc.jobs.repo.get(job.id).inputs == {"text": old}  # old rows still read
    assert svc.jobs.blobs.get(blob.name) == old.encode()
    svc.close()

    assert main(["broker", "seal-at-rest", "--data-dir", str(tmp_path / "b")]) == 0
    assert "sealed 1 job row(s)" in capsys.readouterr().out
    for path in _files(tmp_path / "b"):
        assert old.encode() not in path.read_bytes(), path
    svc = build_services(settings)
    try:
        assert svc.jobs.repo.get(job.id).inputs == {"text": old}
        assert svc.jobs.blobs.get(blob.name) == old.encode()
    finally:
        svc.close()
    assert main(["broker", "seal-at-rest", "--data-dir", str(tmp_path / "b")]) == 0
    assert "sealed 0 job row(s), 0 event(s) and 0 blob" in capsys.readouterr().out


def test_sealed_columns_on_postgresql(pg_url, tmp_path):
    """The same on PostgreSQL: a job's inputs and events are ciphertext in the table and
    plaintext to the broker (the hot path's prepared statements included)."""
    from sqlalchemy import select, type_coerce, JSON

    from broker.services import build_services
    from broker.settings import Settings
    from broker.storage.models import JobRow
    from tests.integration.conftest import seen_provider

    svc = build_services(Settings(data_dir=tmp_path / "b", db_url=pg_url, verification=False))
    try:
        seen_provider(svc, ["echo"])
        _, who = svc.auth.create_account_with_key("client")
        svc.payments.grant(who.account_id, 10**7, by="test")
        job, _ = svc.jobs.submit(who, job_request({"plugin": "echo", "inputs": {"text": "pg-secret"}}, svc.jobs.catalog))
        assert svc.jobs.repo.get(job.id).inputs["text"] == "pg-secret"
        t = JobRow.__table__
        with svc.engine.connect() as c:
            raw = c.execute(select(type_coerce(t.c.inputs, JSON)).where(t.c.id == job.id)
                            ).scalar_one()
        assert set(raw) == {"$sealed"} and "pg-secret" not in str(raw)
        svc.jobs.cancel(who, job.id)  # an event with data, written and read back
        assert [e.kind for e in svc.jobs.repo.events_after(job.id, 0)][0] == "queued"
    finally:
        svc.close()


def test_an_uploaded_file_is_sealed_like_a_put_blob(tmp_path):
    """Streamed uploads move a finished file into place (put_file): in a sealed store its
    bytes are sealed on the way in, and its size is the plaintext's."""
    import hashlib
    import os

    from broker.storage.sealed import AtRestCipher, SealedBlobStore

    store = SealedBlobStore(tmp_path / "blobs", AtRestCipher(os.urandom(32)))
    data = b"a secret image " * 1000
    key = hashlib.sha256(data).hexdigest()
    src = store.tmp_dir() / ".upload-1"
    src.write_bytes(data)
    assert store.put_file(src, key) is True
    assert not src.exists()
    on_disk = store._path(key).read_bytes()
    assert b"a secret image" not in on_disk
    assert store.get(key) == data and store.size(key) == len(data)
    again = store.tmp_dir() / ".upload-2"
    again.write_bytes(data)
    assert store.put_file(again, key) is False and not again.exists()
    assert store.size(store.put(b"small")) == 5


def test_sealing_leaves_a_store_that_seals_its_own_alone(tmp_path):
    """seal-at-rest seals the rows whatever the blob store; a store that is not a sealed
    local folder (an S3 bucket seals its own objects) is neither walked nor rewritten."""
    from broker.blobs.local import LocalBlobStore
    from broker.services import build_services
    from broker.settings import Settings
    from broker.storage.sealed import seal_existing

    svc = build_services(Settings(data_dir=tmp_path / "b", verification=False))
    try:
        other = LocalBlobStore(tmp_path / "elsewhere")
        key = other.put(b"kept as it is")
        assert seal_existing(svc.engine, other) == {"jobs": 0, "events": 0, "blobs": 0}
        assert other._path(key).read_bytes() == b"kept as it is"
    finally:
        svc.close()
