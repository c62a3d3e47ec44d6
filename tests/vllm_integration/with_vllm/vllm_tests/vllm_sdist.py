"""vLLM's own test files, taken at test time from vLLM's source distribution on PyPI.

The wheel ships no tests; the sdist (``vllm-0.33.0.tar.gz``, 47 MB) does. Nothing of it is
copied into this repository: the archive is downloaded once, checked against the sha256
PyPI publishes for it, kept under the running virtual environment
(``<sys.prefix>/kvdefrag-cache/``), and the folders a test needs are extracted into that
test's temporary directory.

NOTE: ``pip download vllm==0.33.0 --no-binary :all:`` cannot fetch it: pip prepares the
sdist's metadata before it saves the file, which runs vLLM's ``setup.py`` (it imports
torch, setuptools-rust and setuptools-scm, and probes for CUDA). The file pip would fetch
(from https://pypi.org/simple/vllm/) is fetched here directly, by the same pinned hash.
``KVDEFRAG_VLLM_SDIST`` names a local copy instead (offline runs).

Usage as a script: ``python vllm_sdist.py DEST [FOLDER ...]`` extracts ``tests/v1/core``
and ``tests/v1/kv_connector/unit`` (or the folders given) under ``DEST``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

VLLM_VERSION = "0.33.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/"
    f"aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/{SDIST_NAME}"
)
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SDIST_ENV = "KVDEFRAG_VLLM_SDIST"
DEFAULT_FOLDERS = ("tests/v1/core", "tests/v1/kv_connector/unit")
_DOWNLOAD_TIMEOUT_S = 300.0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as archive:
        for chunk in iter(lambda: archive.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_sdist(cache_dir: Path | None = None) -> Path:
    """The sdist, checked: ``KVDEFRAG_VLLM_SDIST`` when set, else the cached copy,
    downloaded first if missing.

    Raises:
        ValueError: The file's sha256 is not the one pinned here.
        OSError: The download failed (no route to PyPI, and no local copy).
    """
    local = os.environ.get(SDIST_ENV)
    if local:
        path = Path(local)
    else:
        folder = cache_dir or Path(sys.prefix) / "kvdefrag-cache"
        path = folder / SDIST_NAME
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _download(path)
    found = _sha256(path)
    if found != SDIST_SHA256:
        raise ValueError(f"{path}: sha256 {found}, expected {SDIST_SHA256} ({SDIST_URL})")
    return path


def _download(path: Path) -> None:
    """Downloads the sdist next to ``path`` and renames it there once complete."""
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=".download-")
    try:
        with (
            os.fdopen(handle, "wb") as out,
            urllib.request.urlopen(SDIST_URL, timeout=_DOWNLOAD_TIMEOUT_S) as response,
        ):
            shutil.copyfileobj(response, out)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def extract_tests(sdist: Path, dest: Path, folders: Sequence[str] = DEFAULT_FOLDERS) -> Path:
    """Extracts ``folders`` (paths in vLLM's repository, e.g. ``tests/v1/core``) and the
    ``__init__.py`` of every package above them under ``dest``; returns ``dest``, the
    root to run pytest in (``tests`` is a package there, as in vLLM's checkout).

    Raises:
        ValueError: A member the folders name is not a plain file inside them.
    """
    prefix = PurePosixPath(f"vllm-{VLLM_VERSION}")
    inits = {
        str(PurePosixPath(folder).parents[depth] / "__init__.py")
        for folder in folders
        for depth in range(len(PurePosixPath(folder).parts) - 1)
    }
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            path = PurePosixPath(member.name)
            if path.parts[:1] != prefix.parts:
                continue
            relative = str(path.relative_to(prefix))
            wanted = relative in inits or any(
                relative.startswith(folder + "/") for folder in folders
            )
            if not wanted or member.isdir():
                continue
            if not member.isfile() or ".." in PurePosixPath(relative).parts:
                raise ValueError(f"{sdist}: {member.name} is not a plain file in {folders}")
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None, f"{member.name}: a file member without content"
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out)
    return dest


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} DEST [FOLDER ...]")
    extract_tests(cached_sdist(), Path(sys.argv[1]), sys.argv[2:] or DEFAULT_FOLDERS)
