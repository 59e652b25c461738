"""The weights digest: what an agent advertises for a folder equals what the broker pins
from a manifest's [[weights]] list of the same files."""
import hashlib

from sdk.protocol.digest import file_sha256, files_digest, folder_digest


def test_manifest_digest_equals_the_folder_digest_of_the_same_files(tmp_path):
    files = {"unet/model.safetensors": b"u" * 100, "unet-extra.bin": b"x",
             "a/b": b"1", "a-c": b"2", "config.json": b"{}"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    listed = [(rel, hashlib.sha256(data).hexdigest()) for rel, data in files.items()]
    assert files_digest(listed) == folder_digest(tmp_path)
    assert files_digest(reversed(listed)) == folder_digest(tmp_path)  # order-free
    assert files_digest([("./" + r, h) for r, h in listed]) == folder_digest(tmp_path)


def test_other_weights_give_another_digest(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"weights")
    honest = files_digest([("w.bin", file_sha256(tmp_path / "w.bin"))])
    assert honest == folder_digest(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"other weights")
    assert folder_digest(tmp_path) != honest
    (tmp_path / "w.bin").write_bytes(b"weights")
    (tmp_path / "README").write_text("an extra file changes the folder")
    assert folder_digest(tmp_path) != honest
