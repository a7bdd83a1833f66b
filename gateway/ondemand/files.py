"""The models directory's files changed by name, for Ollama's /api/copy, /api/create
(from an existing model) and /api/delete: only `<name>.gguf` files directly in the
directory, named as scan reads them, so no name reaches outside it (a Hugging Face
directory is a 400: it is changed by hand). A copy is a hard
link where the file system allows (instant, no space), else a copy written under a
temporary name and renamed, so a reader never sees half a file. Blocking: called in a
worker thread.
"""

from __future__ import annotations

import os
import shutil

from gateway.ondemand.scan import MAX_NAME_CHARS, NAME, SUFFIX, Found


class FileError(Exception):
    """What the client asked cannot be done; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_name(name: str) -> None:
    if len(name) > MAX_NAME_CHARS or not NAME.fullmatch(name):
        raise FileError(
            400,
            f"{name[:MAX_NAME_CHARS]!r} is not a model name for the models directory "
            f"(letters, digits, _ . + -, at most {MAX_NAME_CHARS} characters)",
        )


def copy(directory: str, source: Found, destination: str) -> None:
    check_name(destination)
    _a_file(source)
    target = os.path.join(directory, destination + SUFFIX)
    if os.path.lexists(target):
        raise FileError(400, f"model {destination!r} exists already: delete it first")
    try:
        os.link(source.path, target)
        return
    except OSError:
        pass  # another file system, or none that links: a copy
    partial = os.path.join(directory, f".{destination}{SUFFIX}.partial")
    try:
        shutil.copyfile(source.path, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def delete(found: Found) -> None:
    """The model's file (its link in the directory: a file it was copied from stays)."""
    _a_file(found)
    os.remove(found.path)


def _a_file(found: Found) -> None:
    """A Hugging Face model's directory is copied or removed by hand, not by a request
    (a tree of files, perhaps linked from elsewhere)."""
    if found.kind != "local":
        raise FileError(
            400,
            f"model {found.name!r} is a Hugging Face directory: copy or remove it in the "
            "models directory by hand",
        )
