"""broker.providers.defaults.WeightsDefaults: a job that leaves out the image size gets the
size every provider that could run it agrees its weights give, else the manifest's."""
import json
import logging

from broker.catalog.registry import PluginCatalog
from broker.providers.defaults import WeightsDefaults
from broker.settings import BUILTIN_PLUGINS

TINY, OTHER = "a" * 64, "b" * 64
SD15_VERSION = PluginCatalog.from_folders([BUILTIN_PLUGINS]).get("sd15").version
SMALL = json.dumps({"width": 64, "height": 64})


def _index():
    catalog = PluginCatalog.from_folders([BUILTIN_PLUGINS])
    return WeightsDefaults(catalog), catalog.get("sd15")


def _sd15(digest=TINY, defaults=SMALL, version=SD15_VERSION):
    return [{"name": "sd15", "version": version, "weights_digest": digest,
             "input_defaults": defaults}]


def test_the_providers_agreed_size_fills_in_and_goes_with_them():
    index, sd15 = _index()
    assert index.for_job(sd15) == {}  # nobody online: the manifest's 512 stands
    a, b = object(), object()
    index.update("p1", _sd15(), session=a)
    index.update("p2", _sd15(), session=b)
    assert index.for_job(sd15) == {"width": 64, "height": 64}
    index.forget("p1", session=a)
    index.forget("p2", session=b)
    assert index.for_job(sd15) == {}


def test_disagreeing_weights_leave_the_manifest_default_unless_the_job_pins_some():
    index, sd15 = _index()
    index.update("tiny", _sd15(TINY, SMALL))
    index.update("real", _sd15(OTHER, json.dumps({"width": 512, "height": 512})))
    assert index.for_job(sd15) == {}
    assert index.for_job(sd15, TINY) == {"width": 64, "height": 64}
    assert index.for_job(sd15, OTHER) == {}  # 512 is the manifest's own
    # an agent that reports nothing counts as giving the manifest's default
    index.forget("real")
    index.update("old-agent", _sd15(OTHER, ""))
    assert index.for_job(sd15) == {} and index.for_job(sd15, TINY) == {"width": 64,
                                                                        "height": 64}


def test_an_agent_that_reconnected_keeps_its_report_when_the_old_stream_closes():
    index, sd15 = _index()
    old, new = object(), object()
    index.update("p1", _sd15(), session=old)
    index.update("p1", _sd15(), session=new)
    index.forget("p1", session=old)
    assert index.for_job(sd15) == {"width": 64, "height": 64}


def test_a_report_the_manifest_refuses_counts_as_none(caplog):
    index, sd15 = _index()
    caplog.set_level(logging.WARNING, logger="broker.providers.defaults")
    for bad in ('{"width": 4096, "height": 64}', '{"steps": 1}', "not json", "[64]",
                "[" * 5000, json.dumps({"width": 64, "pad": "x" * 5000})):
        index.update("p1", _sd15(defaults=bad))
        assert index.for_job(sd15) == {}, bad
    assert all("refused" in r.getMessage() for r in caplog.records) and len(caplog.records) == 6
    index.update("p1", _sd15(version="9.9.9"))  # a build the catalog does not know
    assert index.for_job(sd15) == {}
