"""Regenerate the Python stubs of the wire contract: ``python protos/generate.py [--out DIR]``.

The stubs are committed next to the .proto files so that installing stablewatch needs no
compiler; ``tests/test_protos_fresh.py`` fails when they are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "stablewatch" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Compile every .proto under protos/stablewatch/v1 into ``out_dir``: messages, type stubs, services."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    includes = [f"-I{PROTO_ROOT}", f"-I{well_known}"]
    with_services = [p for p in PROTO_FILES if "\nservice " in (PROTO_ROOT / p).read_text()]
    runs = [
        [f"--python_out={out_dir}", f"--pyi_out={out_dir}", *map(str, PROTO_FILES)],
        [f"--grpc_python_out={out_dir}", *map(str, with_services)],
    ]
    for run in runs:
        if protoc.main(["protoc", *includes, *run]) != 0:
            raise SystemExit(f"protoc failed: {' '.join(run)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: protos/)")
    out = parser.parse_args().out
    generate(out)
    print(f"generated stubs for {len(PROTO_FILES)} files under {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
