"""The LM example's corpus: the Python standard library's own source, as one byte-token file.

Every machine with Python has the corpus: the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (site-packages, dist-packages and __pycache__ left out),
in sorted order of their relative paths, each followed by a newline, cut at ``max_bytes``.
The bytes are the tokens (vocabulary 256). The file is a NumPy ``.npy`` of uint8, read
memory-mapped, with a JSON manifest beside it (Python version, files, bytes, sha256).

Idempotent and quick (a few MB read once): an existing file is kept. The write goes to a
temporary name first and is renamed into place, so processes preparing at once (a client
and the workers of one host) all end with the same complete file. The corpus depends on
the Python version (the stdlib changes), so the file name carries it; all hosts of a run
must read the same file (same Python, or a shared ``LM_DATA_DIR``).

    python examples/lm/prepare.py [--data-dir DIR] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_MAX_BYTES = 4 << 20
SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_data_dir() -> Path:
    """``LM_DATA_DIR``, else ``$XDG_CACHE_HOME/rallypoint/lm`` (``~/.cache/rallypoint/lm``): an absolute
    path that a client and the workers of the same host agree on."""
    if os.environ.get("LM_DATA_DIR"):
        return Path(os.environ["LM_DATA_DIR"]).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser().resolve() / "rallypoint" / "lm"


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``*.py`` files, sorted by their path relative to it."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    found = [p for p in root.rglob("*.py") if p.is_file() and not SKIP & set(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def token_path(data_dir: Path, max_bytes: int) -> Path:
    return data_dir / f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-{max_bytes}.npy"


def corpus_bytes(max_bytes: int, root: Path | None = None) -> tuple[bytes, int]:
    """The first ``max_bytes`` of the corpus, and how many files it draws from."""
    out = bytearray()
    files = 0
    for path in corpus_files(root):
        if len(out) >= max_bytes:
            break
        out += path.read_bytes() + b"\n"
        files += 1
    return bytes(out[:max_bytes]), files


def prepare(data_dir: Path | str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Write the token file unless it is there; return its path."""
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2, got {max_bytes}")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    path = token_path(data_dir, max_bytes)
    if path.is_file():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    text, files = corpus_bytes(max_bytes)
    tokens = np.frombuffer(text, dtype=np.uint8)
    manifest = {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"], "files": files,
                "bytes": len(text), "max_bytes": max_bytes, "sha256": hashlib.sha256(text).hexdigest()}
    for target, write in ((path.with_suffix(".json"), lambda f: f.write(json.dumps(manifest, indent=1).encode())),
                          (path, lambda f: np.save(f, tokens))):  # the manifest first: the .npy marks "done"
        fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600: let the workers' user read it too
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=None, help="default: LM_DATA_DIR or ~/.cache/rallypoint/lm")
    ap.add_argument("--max-bytes", type=int, default=int(os.environ.get("LM_CORPUS_BYTES", DEFAULT_MAX_BYTES)))
    args = ap.parse_args()
    path = prepare(args.data_dir, args.max_bytes)
    manifest = json.loads(path.with_suffix(".json").read_text())
    print(f"{path}: {manifest['bytes']} tokens from {manifest['files']} files of {manifest['stdlib']}")


if __name__ == "__main__":
    main()
