"""Generate the Python stubs of protos/rollout.proto; `--check` fails when they are stale."""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = Path("protos") / "rollout.proto"
STUBS = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) with the repository root as the import path."""
    try:
        from grpc_tools import protoc
    except ImportError:
        sys.exit("grpcio-tools is not installed: pip install grpcio-tools")
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    status = protoc.main([
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / PROTO),
    ])
    if status != 0:
        sys.exit(f"protoc failed with status {status}")


def stale_stubs(generated_dir: Path) -> list[str]:
    """Stub files whose content differs from a fresh generation (or that are missing)."""
    target = ROOT / "protos"
    return [
        name for name in STUBS
        if not (target / name).exists()
        or not filecmp.cmp(generated_dir / "protos" / name, target / name, shallow=False)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed stubs are out of date"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if args.check:
            stale = stale_stubs(Path(tmp))
            if stale:
                print(f"stale stubs: {stale}; run `python scripts/gen_proto.py`", file=sys.stderr)
                return 1
            print("protos are up to date")
            return 0
        for name in STUBS:
            shutil.copyfile(Path(tmp) / "protos" / name, ROOT / "protos" / name)
    print(f"wrote {', '.join(f'protos/{n}' for n in STUBS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
