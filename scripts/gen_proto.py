"""Regenerate jitllmd/gen/ from proto/jitllm/v1/*.proto: google-protobuf messages and connectrpc stubs.

    python scripts/gen_proto.py            # rewrite jitllmd/gen/
    python scripts/gen_proto.py --check    # exit 1 if jitllmd/gen/ differs from what the protos generate

Needs grpcio-tools and protoc-gen-connectrpc (the test extra has both). protoc writes imports as the protos name
their packages (`from jitllm.v1 import common_pb2`); they are rewritten to live under `jitllmd.gen`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "jitllmd" / "gen"
HEADER = '"""Generated from proto/ by scripts/gen_proto.py: never edit by hand."""\n'


def generate(dest: Path) -> None:
    """Write the generated package into `dest` (which becomes jitllmd/gen)."""
    plugin = Path(sys.executable).parent / "protoc-gen-connectrpc"
    if not plugin.exists():
        sys.exit(f"needs protoc-gen-connectrpc next to {sys.executable}: pip install protoc-gen-connectrpc grpcio-tools")
    protos = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}",
            f"--python_out={tmp}", f"--pyi_out={tmp}",
            f"--plugin=protoc-gen-connectrpc={plugin}", f"--connectrpc_out={tmp}", "--connectrpc_opt=protobuf=google",
            *protos,
        ]
        subprocess.run(cmd, check=True, cwd=ROOT)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "__init__.py").write_text(HEADER)
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            text = re.sub(r"\bfrom jitllm\.v1\b", "from jitllmd.gen.jitllm.v1", src.read_text())
            text = re.sub(r"^import jitllm\.v1\.(\w+)", r"import jitllmd.gen.jitllm.v1.\1", text, flags=re.M)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        for d in [p for p in dest.rglob("*") if p.is_dir()]:
            (d / "__init__.py").write_text(HEADER)


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py*")) if "__pycache__" not in p.parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if jitllmd/gen/ is stale")
    a = ap.parse_args()
    if a.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "gen"
            generate(fresh)
            if _files(fresh) != _files(OUT):
                sys.exit("jitllmd/gen/ is stale: run python scripts/gen_proto.py")
        print("jitllmd/gen/ is up to date")
        return
    if OUT.exists():
        shutil.rmtree(OUT)
    generate(OUT)
    print(f"wrote {OUT.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
