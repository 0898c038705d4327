"""The build generates the gRPC and protobuf stubs from proto/ itself (issue 34).

Stubs are never committed: without this, `pip install .`, a wheel or an sdist built from a
clean checkout, or `pip install git+...` gave a package that could not import. Every build
(wheel, sdist's wheel, editable) runs protoc from the pinned `grpcio-tools` of
`[build-system].requires` before it collects the packages, so the stubs always match
`proto/`, and the runtime floors in `[project].dependencies` are the versions those stubs
demand (their generated code refuses an older grpcio or protobuf at import).

`python setup.py stubs` generates them in place and nothing else: `make proto` runs that, so
the Makefile and the build share one command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"


def generate_stubs() -> None:
    """protoc over every .proto under proto/, into the packages beside them (wal/v1,
    kvstore/v1, kvstore/internal/v1): *_pb2.py, *_pb2.pyi, *_pb2_grpc.py."""
    from grpc_tools import protoc  # the build requirement; imported late so `setup.py --help` works without it

    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}: the stubs cannot be generated (is proto/ "
                         "in the sdist? MANIFEST.in includes it)")
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto, as `python -m grpc_tools.protoc`
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT.relative_to(ROOT)}", f"-I{include}", "--python_out=.",
            "--pyi_out=.", "--grpc_python_out=.", *protos]
    previous = Path.cwd()
    try:
        os.chdir(ROOT)
        status = protoc.main(args)
    finally:
        os.chdir(previous)
    if status != 0:
        raise SystemExit(f"protoc failed (exit {status}) on {len(protos)} files under proto/")


if __name__ == "__main__" and sys.argv[1:] == ["stubs"]:
    generate_stubs()
    sys.exit(0)

from setuptools import setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402
from setuptools.command.sdist import sdist  # noqa: E402


class BuildPyWithStubs(build_py):
    """Generate the stubs, then collect the packages as usual (they are .py files by then)."""

    def run(self) -> None:
        generate_stubs()
        super().run()


class SdistWithStubs(sdist):
    """An sdist carries proto/ (MANIFEST.in) and is built into a wheel by the command above; the
    stubs are generated here too, so an sdist never ships stubs older than its .proto files."""

    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithStubs})
