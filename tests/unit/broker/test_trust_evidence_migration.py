"""Migration 0017 on a database already at 0016 as it landed (issue #20's evidence tables
with the two counters nothing reads): the rows stay, the columns go, the repository
writes to it, and it goes down and up again."""
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from broker.storage.base import make_engine
from broker.storage.migrate import downgrade, upgrade
from broker.storage.verification_sql import SqlVerificationRepository


def test_0017_drops_the_unread_counters_and_keeps_the_evidence(db_url):
    engine = make_engine(db_url)
    try:
        upgrade(engine, "0016_trust_evidence")
        with engine.begin() as c:
            c.execute(text("INSERT INTO sampling_evidence (provider_id, plugin, witness, "
                           "checks, log_s, closed, updated_at) "
                           "VALUES ('p', 'llama', 'op-w', 2, 1.5, 0, 1.0)"))
            c.execute(text("INSERT INTO canary_misses (provider_id, plugin, recent, missed, "
                           "updated_at) VALUES ('p', 'llama', 'am', 1, 1.0)"))
        upgrade(engine)
        repo = SqlVerificationRepository(sessionmaker(engine, expire_on_commit=False))
        assert repo.sampling_state("p", "llama", "op-w").checks == 2
        assert repo.canary_outcome("p", "llama", "o", 8) == "amo"
        downgrade(engine, "0016_trust_evidence")
        upgrade(engine)
        assert repo.canary_outcome("p", "llama", "a", 8) == "amoa"
    finally:
        engine.dispose()
