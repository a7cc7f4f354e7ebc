"""The conversion cache: a GGUF file converted once to a Hugging Face directory (model.safetensors,
config.json, tokenizer.json, tokenizer_config.json), so later starts skip dequantization.

Location: the `cache_dir` argument, else $KVPACT_CACHE_DIR, else ~/.cache/kvpact (read when called,
never at import). An entry is keyed by the source file's absolute path, size and mtime, so a changed
file gets a new entry. Entries appear atomically: written into a temporary sibling directory, then
renamed into place; a directory under its final name is always complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "KVPACT_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from_env = os.environ.get(CACHE_ENV)
    return Path(from_env) if from_env else Path.home() / ".cache" / "kvpact"


def entry_dir(root: Path, source: Path) -> Path:
    """Where the converted copy of `source` lives (it may not exist yet)."""
    source = source.resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / "gguf" / f"{source.stem}-{key}"


def write_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)`, then rename tmp_dir to `final`. If another process got there first, its
    entry is kept and ours discarded. Raises OSError when the cache cannot be written."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
