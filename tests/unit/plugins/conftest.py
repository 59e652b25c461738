"""Fixtures for the built-in plugin tests: tiny weights built once per session, plugins
loaded from their folders the way a plugin host does (manifest entrypoint), and a fake
RunContext that records progress and stream calls and can cancel at a chosen step."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plugins import builtin_plugin_dir
from plugins.api import Cancelled, Plugin
from sdk.protocol.manifest import Manifest, load_manifest


class FakeContext:
    """A RunContext for tests. ``cancel_at_step``: cancelled once that progress step is seen."""

    def __init__(self, cancel_at_step: int | None = None, job_id: str = "job-test",
                 scratch_dir: Path = Path("/tmp")):
        self.job_id = job_id
        self.scratch_dir = scratch_dir
        self.cancel_at_step = cancel_at_step
        self.progress_calls: list[tuple[int, int]] = []
        self.streamed: list[tuple[str, list[int] | None]] = []
        self._cancelled = False

    def progress(self, step: int, total: int, message: str = "") -> None:
        self.progress_calls.append((step, total))
        if self.cancel_at_step is not None and step >= self.cancel_at_step:
            self._cancelled = True

    def stream(self, text: str, token_ids: list[int] | None = None) -> None:
        self.streamed.append((text, token_ids))

    def cancelled(self) -> bool:
        return self._cancelled

    def check_cancelled(self) -> None:
        if self._cancelled:
            raise Cancelled(f"job {self.job_id} was cancelled")


def load_builtin(name: str) -> tuple[Plugin, Manifest]:
    """Instantiate a built-in plugin from its folder through the manifest's entrypoint."""
    folder = builtin_plugin_dir(name)
    manifest = load_manifest(folder)
    module_name, class_name = manifest.entrypoint.split(":")
    spec = importlib.util.spec_from_file_location(
        f"_sparecycles_test_plugin_{name}", folder / f"{module_name.replace('.', '/')}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = getattr(module, class_name)()
    plugin.manifest = manifest
    return plugin, manifest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The test machines' cores are shared: two spinning OpenMP threads on two busy cores
    run many times slower than one thread, so the tiny models run single-threaded."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_ctx():
    """The FakeContext class: ``make_ctx()`` or ``make_ctx(cancel_at_step=2)``."""
    return FakeContext


@pytest.fixture
def ckpt_ctx(make_ctx):
    """A FakeContext class that also checkpoints: ``ckpt_ctx(every=2)`` records each
    checkpoint in ``.checkpoints`` ({step: bytes}); ``ckpt_ctx(resume=data)`` resumes."""
    class CheckpointContext(make_ctx):
        def __init__(self, every: int = 0, resume: bytes | None = None, **kw):
            super().__init__(**kw)
            self.checkpoint_every = every
            self.resume_from = resume
            self.checkpoints: dict[int, bytes] = {}

        def checkpoint(self, step: int, data: bytes) -> None:
            self.checkpoints[step] = data

    return CheckpointContext


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-weights")


@pytest.fixture(scope="session")
def sd15_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_sd15

    return build_tiny_sd15(tiny_dir / "sd15", seed=0)


@pytest.fixture(scope="session")
def sdxl_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_sdxl

    return build_tiny_sdxl(tiny_dir / "sdxl", seed=0)


@pytest.fixture(scope="session")
def llama_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_llama

    return build_tiny_llama(tiny_dir / "llama", seed=0)


@pytest.fixture(scope="session")
def sd15(sd15_weights):
    plugin, manifest = load_builtin("sd15")
    plugin.setup(sd15_weights, "cpu")
    yield plugin, manifest
    plugin.teardown()


@pytest.fixture(scope="session")
def sdxl(sdxl_weights):
    plugin, manifest = load_builtin("sdxl")
    plugin.setup(sdxl_weights, "cpu")
    yield plugin, manifest
    plugin.teardown()


@pytest.fixture(scope="session")
def llama(llama_weights):
    plugin, manifest = load_builtin("llama")
    plugin.setup(llama_weights, "cpu")
    yield plugin, manifest
    plugin.teardown()
