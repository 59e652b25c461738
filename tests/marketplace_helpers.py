"""Builders shared by the marketplace tests: small plugin and adapter folders (no torch),
and publishing them through a RegistryService the way `sparecycles publish` does."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

from plugins import builtin_plugin_dir
from sdk.protocol.package import build_document, publisher_proof_document, sign_document
from sdk.protocol.signing import KeyPair


def plugin_folder(root: Path, name: str = "reverse", version: str = "1.0.0", *,
                  weights: dict[str, bytes] | None = None, drop: str | None = None) -> Path:
    """A plugin folder made from the echo plugin, renamed; ``weights`` files go under
    weights/ and into the manifest; ``drop`` removes a top-level manifest key."""
    folder = root / f"{name}-{version}-{os.urandom(3).hex()}"
    folder.mkdir(parents=True)
    src = builtin_plugin_dir("echo")
    (folder / "plugin.py").write_text((src / "plugin.py").read_text())
    lines = []
    for line in (src / "plugin.toml").read_text().splitlines():
        if line.startswith("name = "):
            line = f'name = "{name}"'
        elif line.startswith("version = "):
            line = f'version = "{version}"'
        elif line.startswith("publisher = "):
            line = 'publisher = "acme"'
        if drop and line.startswith(f"{drop} = "):
            continue
        lines.append(line)
    for path, data in (weights or {}).items():
        import hashlib

        target = folder / "weights" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        lines += ["", "[[weights]]", f'path = "{path}"',
                  f'sha256 = "{hashlib.sha256(data).hexdigest()}"', f"size = {len(data)}"]
    (folder / "plugin.toml").write_text("\n".join(lines) + "\n")
    return folder


def adapter_folder(root: Path, name: str = "ink", version: str = "1.0.0", *, base: str = "sd15",
                   royalty: int | None = 500, declared_base: str | None = None,
                   payload: bytes | None = None, omit: str | None = None) -> Path:
    """An adapter folder: adapter.toml, a .safetensors payload (random bytes: the registry
    never parses it) and an adapter.json declaring ``declared_base`` (default ``base``)."""
    folder = root / f"{name}-{version}-{os.urandom(3).hex()}"
    folder.mkdir(parents=True)
    fields = {"name": name, "version": version, "base": base, "description": f"{name} style"}
    if royalty is not None:
        fields["royalty_micro"] = royalty
    if omit:
        fields.pop(omit)
    (folder / "adapter.toml").write_text("".join(
        f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    (folder / "pytorch_lora_weights.safetensors").write_bytes(payload or os.urandom(4096))
    (folder / "adapter.json").write_text(json.dumps({"base_model": declared_base or base}))
    return folder


def register(registry, who, keys: KeyPair | None = None) -> KeyPair:
    keys = keys or KeyPair.generate()
    registry.register_key(who, keys.public_key_hex,
                          keys.sign("publisher", publisher_proof_document(
                              who.account_id, keys.public_key_hex)), "test")
    return keys


def publish(registry, who, keys: KeyPair, folder: Path, *, royalty: int | None = None,
            document: dict | None = None, signature: str | None = None):
    """Upload the folder's files and publish its signed document (as the CLI does)."""
    document = document or build_document(folder, keys.public_key_hex, royalty_micro=royalty)
    for f in document["files"]:
        registry.put_blob_stream(who, f["sha256"], io.BytesIO((folder / f["path"]).read_bytes()))
    return registry.publish(who, document,
                            sign_document(keys, document) if signature is None else signature)
