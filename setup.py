"""Build hook: compile the wire contract (sdk/protocol/*.proto) with grpcio-tools.

The generated *_pb2.py / *_pb2_grpc.py modules are build outputs, never committed. They are
written next to the .proto sources so that editable installs (`pip install -e .`) see them
as well as regular wheels.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def compile_protos() -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in sorted((ROOT / "sdk" / "protocol").glob("*.proto")):
        rel = proto.relative_to(ROOT).as_posix()
        rc = protoc.main(
            ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}",
             f"--grpc_python_out={ROOT}", rel]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")


class BuildWithProtos(build_py):
    def run(self):
        compile_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
