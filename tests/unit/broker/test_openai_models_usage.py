"""The OpenAI-compatible routes' two small rules without a model running: ``usage`` counts
are integers whatever a provider's meta says, and one lookup answers both the endpoints'
``model`` and ``GET /v1/models/<name>``."""
from __future__ import annotations

import pytest

from broker.api.openai_compat import usage_of
from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings


def test_usage_counts_are_whole_numbers_whatever_the_meta_says():
    metas = [{"prompt_tokens": 7.0, "generated_tokens": 5},
             {"prompt_tokens": "7", "generated_tokens": 2.5},
             {"prompt_tokens": float("nan"), "generated_tokens": float("inf")},
             {"prompt_tokens": True, "generated_tokens": -3},
             {"generated_tokens": 1 << 40}, {}]
    usage = usage_of(metas)
    assert usage == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert all(type(v) is int for v in usage.values())
    assert usage_of([]) == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@pytest.fixture
def api(tmp_path):
    svc = build_services(Settings(data_dir=tmp_path / "b", verification=False))
    key, _ = svc.auth.create_account_with_key("client")
    client = create_app(svc).test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    yield client
    svc.close()


def test_a_model_is_looked_up_one_way_for_every_route(api):
    listed = {m["id"] for m in api.get("/v1/models").json["data"]}
    assert "llama" in listed and "echo" not in listed
    got = api.get("/v1/models/llama")
    assert got.status_code == 200 and got.json["id"] == "llama"
    assert "chat.completions" in got.json["sparecycles"]["endpoints"]
    for name in ("gpt-4o", "echo", "llama@9.9.9"):  # unknown, serves no endpoint, no version
        missing = api.get(f"/v1/models/{name}")
        err = missing.json["error"]  # OpenAI's error shape
        assert missing.status_code == 404 and err["code"] == "model_not_found"
        assert repr(name) in err["message"] and "llama" in err["message"]
    # the endpoints' own lookup: the same answer, naming the endpoint
    wrong = api.post("/v1/images/generations", json={"model": "llama", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json["error"]["code"] == "model_not_found"
    assert "/v1/images/generations" in wrong.json["error"]["message"]
