"""Default data directories lie outside the source tree: a broker's keys and database, and
the demo's agent homes, must never be where a checkout (parts of which plugin hosts see)
would put them."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]


def test_the_brokers_default_data_dir_is_the_user_data_dir_not_the_working_dir(
        tmp_path, monkeypatch):
    from broker.settings import Settings

    monkeypatch.chdir(PROJECT)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("SPARECYCLES_DATA_DIR", raising=False)
    settings = Settings()
    assert settings.data_dir == tmp_path / "data" / "sparecycles" / "broker"
    assert settings.key_path == settings.data_dir / "broker.key"
    assert not settings.data_dir.resolve().is_relative_to(PROJECT)
    assert Settings.from_env({"SPARECYCLES_DATA_DIR": str(tmp_path / "x")}).data_dir == \
        tmp_path / "x"


def test_a_broker_started_beside_an_old_default_data_dir_says_how_to_keep_it(
        tmp_path, monkeypatch, caplog):
    from broker.cli import _settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    (tmp_path / ".sparecycles").mkdir()
    (tmp_path / ".sparecycles" / "broker.key").write_text("old")
    args = argparse.Namespace(data_dir=None, db=None, blob_dir=None)
    with caplog.at_level(logging.WARNING):
        settings = _settings(args)
    assert settings.data_dir == tmp_path / "data" / "sparecycles" / "broker"
    assert "pass --data-dir .sparecycles" in caplog.text


def test_the_demo_keeps_its_broker_and_agents_in_the_user_cache_dir(tmp_path, monkeypatch):
    from sdk.commands import register
    from sdk.demo import default_workdir

    monkeypatch.delenv("SPARECYCLES_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_workdir() == tmp_path / "cache" / "sparecycles" / "demo"
    monkeypatch.setenv("SPARECYCLES_CACHE_DIR", str(tmp_path / "mine"))
    assert default_workdir() == tmp_path / "mine" / "demo"
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["demo"]).workdir is None  # run_demo then uses default_workdir
