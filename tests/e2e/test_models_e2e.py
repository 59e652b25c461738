"""The model plugins end to end: real broker and agent processes, tiny sdxl, llama (streamed
token by token through agent -> broker -> SSE -> SDK) and sd15 with a LoRA adapter."""
import shutil
import time

import pytest

from sdk import Client

SANDBOX = shutil.which("bwrap") is not None

pytestmark = [pytest.mark.e2e, pytest.mark.localnet(lease_timeout_s=10)]


def test_sdxl_streamed_llama_and_sd15_with_an_adapter(localnet, model_weights):
    localnet.start_broker()
    provider_key = localnet.create_key("provider")
    client = Client(localnet.url, localnet.create_key("client"))
    localnet.start_agent("models", provider_key, plugins="sd15,sdxl,llama",
                         weights_dir=model_weights, sandbox=SANDBOX)
    localnet.wait_for_providers(1)

    xl = client.generate("sdxl", prompt="a lighthouse at dusk", steps=2, width=64,
                         height=64, seed=5, timeout=120)
    assert xl.images[0].size == (64, 64)

    # Streamed llama: each token arrives (with its arrival time) before the job ends.
    arrivals = []
    for token in client.stream("llama", prompt="Once upon a time", max_new_tokens=24,
                               temperature=0.0, ignore_eos=True, seed=0, timeout=120):
        arrivals.append((time.monotonic(), token))
    tokens = [t for _, t in arrivals]
    assert len(tokens) >= 5
    job = client.jobs.get(client.jobs.list(limit=1)[0].id)
    assert job.data["plugin"] == "llama"
    final = job.wait(timeout=30)
    assert "".join(tokens) == final.text
    ended = next(e for e in client.jobs.get(job.id).events() if e.kind == "done")
    token_events = [e for e in client.jobs.get(job.id).events() if e.kind == "token"]
    assert len(token_events) == len(tokens) and token_events[-1].id < ended.id

    base = client.generate("sd15", prompt="a red cube", steps=3, width=64, height=64,
                           seed=2, timeout=120)
    ink = client.generate("sd15", prompt="a red cube", steps=3, width=64, height=64, seed=2,
                          adapters="ink:1", timeout=120)
    zero = client.generate("sd15", prompt="a red cube", steps=3, width=64, height=64, seed=2,
                           adapters="ink:0", timeout=120)
    assert ink.output_bytes(0) != base.output_bytes(0)
    assert zero.output_bytes(0) == base.output_bytes(0)

    # The README's first example, as written but for a shorter timeout: no size, so the
    # size the tiny weights give (64×64, as diffusers would pick), in a second or two;
    # 512×512 on these weights took over half an hour on a CPU (issue #30).
    first = client.generate("sd15", prompt="a lighthouse at dusk", seed=7, steps=30,
                            timeout=120)
    assert first.images[0].size == (64, 64) and first.job.data["inputs"]["width"] == 64
    client.close()
