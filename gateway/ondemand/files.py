"""The models directory's files changed by name, for Ollama's /api/copy, /api/create
(from an existing model) and /api/delete: only `<name>.gguf` files directly in the
directory (with their `mmproj-<name>.gguf` projector, where one is paired), named as
scan reads them, so no name reaches outside it (a Hugging Face directory, or a
subdirectory of GGUF files, is a 400: it is changed by hand). A copy is a hard
link where the file system allows (instant, no space), else a copy written under a
temporary name and renamed, so a reader never sees half a file. Blocking: called in a
worker thread.
"""

from __future__ import annotations

import os
import shutil

from gateway.ondemand.scan import MAX_NAME_CHARS, NAME, PROJECTOR, SUFFIX, Found


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
    _a_file(directory, source)
    target = os.path.join(directory, destination + SUFFIX)
    copies = [(source.path, target)]
    if source.mmproj is not None:  # its projector first: the model appears with it
        projector = os.path.join(directory, f"{PROJECTOR}-{destination}{SUFFIX}")
        copies.insert(0, (source.mmproj, projector))
    for _, path in copies:
        if os.path.lexists(path):
            name = os.path.basename(path)
            raise FileError(
                400, f"{name!r} exists already in the models directory: delete it first"
            )
    for path, to in copies:
        _link_or_copy(directory, path, to)


def _link_or_copy(directory: str, path: str, target: str) -> None:
    try:
        os.link(path, target)
        return
    except OSError:
        pass  # another file system, or none that links: a copy
    partial = os.path.join(directory, f".{os.path.basename(target)}.partial")
    try:
        shutil.copyfile(path, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def delete(directory: str, found: Found) -> None:
    """The model's file and its projector's (their links in the directory: a file they
    were copied from stays)."""
    _a_file(directory, found)
    os.remove(found.path)
    if found.mmproj is not None:  # named for this model alone (scan's pairs)
        os.remove(found.mmproj)


def _a_file(directory: str, found: Found) -> None:
    """A Hugging Face model's directory, or a subdirectory of GGUF files, is copied or
    removed by hand, not by a request (a tree of files, perhaps linked from elsewhere)."""
    if found.kind != "local":
        raise FileError(
            400,
            f"model {found.name!r} is a Hugging Face directory: copy or remove it in the "
            "models directory by hand",
        )
    if os.path.dirname(os.path.abspath(found.path)) != os.path.abspath(directory):
        raise FileError(
            400,
            f"model {found.name!r} is a subdirectory of the models directory: copy or "
            "remove it by hand",
        )
