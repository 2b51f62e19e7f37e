"""The committed Python stubs must be exactly what the .proto files generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PROTOS = ROOT / "protos"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(PROTOS / "generate.py"), "--out", str(tmp_path)], check=True)
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*_pb2*.py*")}
    committed = {p.relative_to(PROTOS): p.read_bytes() for p in PROTOS.rglob("*_pb2*.py*")}
    assert generated, "protoc generated nothing"
    assert sorted(generated) == sorted(committed), "stub files differ: run `make protos`"
    stale = [str(name) for name in generated if generated[name] != committed[name]]
    assert not stale, f"stale stubs (run `make protos`): {stale}"


def test_stubs_import_as_stablewatch_v1() -> None:
    from stablewatch.v1 import channel_pb2_grpc, control_pb2_grpc, query_pb2_grpc

    assert hasattr(channel_pb2_grpc, "PeerStub")
    assert hasattr(control_pb2_grpc, "ControlServicer")
    assert hasattr(query_pb2_grpc, "add_QueryServicer_to_server")
