"""A path in an object store (`s3://bucket/prefix/...`), with the part of pathlib's API that the run's
readers and writers use, over one pyarrow filesystem: so they take a local `Path` or an `ObjectPath`
alike, and a local run directory is one case of the same code, not a second one.

What differs from a local path, and why:
- there are no directories, only keys with a common prefix: `mkdir` makes nothing, `is_dir` is true
  where some key lies below, and `rename` of a directory copies each object, then deletes it (no rename
  exists); the store copies them server-side;
- `write_text`/`write_bytes` are one upload each, which a reader sees whole or not at all (the object
  appears when the upload completes): as atomic as the local temp-and-rename (run_files.write_atomic);
- `open("rb")` is a seekable file whose reads are ranged GETs, so a zip's central directory is read
  without its tensors (checkpoint/files.py).
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass
from typing import IO, Any, Iterator


@dataclass(frozen=True)
class Size:
    """What `stat()` tells of an object: its size and when it was written (pathlib's os.stat_result,
    as far as it is used)."""

    st_size: int
    st_mtime: float


class ObjectPath:
    """`scheme://bucket/key` on `fs`, a pyarrow filesystem of that store. Immutable, like a Path."""

    def __init__(self, fs: Any, scheme: str, key: str) -> None:
        self.fs, self.scheme = fs, scheme
        self.key = posixpath.normpath(key.strip("/")) if key.strip("/") else ""
        """bucket/prefix/...: the path on `fs`."""

    # --- names ---
    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part: str | Any) -> ObjectPath:
        return ObjectPath(self.fs, self.scheme, posixpath.join(self.key, str(part)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.fs, self.scheme, posixpath.dirname(self.key))

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def with_suffix(self, suffix: str) -> ObjectPath:
        stem, _ = posixpath.splitext(self.name)
        return self.with_name(stem + suffix)

    def absolute(self) -> ObjectPath:
        return self

    def expanduser(self) -> ObjectPath:
        return self

    # --- what is there ---
    def info(self) -> Any:
        return self.fs.get_file_info(self.key)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        from pyarrow.fs import FileType

        return self.info().type == FileType.File

    def is_dir(self) -> bool:
        from pyarrow.fs import FileType

        return self.info().type == FileType.Directory

    def stat(self) -> Size:
        info = self.info()
        if info.size is None:
            raise FileNotFoundError(f"no such object: {self}")
        return Size(info.size, info.mtime.timestamp() if info.mtime is not None else 0.0)

    def iterdir(self) -> Iterator[ObjectPath]:
        from pyarrow.fs import FileSelector

        for info in self.fs.get_file_info(FileSelector(self.key, allow_not_found=True)):
            yield ObjectPath(self.fs, self.scheme, info.path)

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """One level only (`checkpoint_*`, `rank-*.pt`): what the run's readers ask."""
        if "/" in pattern:
            raise ValueError(f"ObjectPath.glob takes one level only, not {pattern!r}")
        return (path for path in self.iterdir() if fnmatch.fnmatchcase(path.name, pattern))

    # --- reads and writes ---
    def open(self, mode: str = "rb") -> IO[bytes]:
        """"rb": seekable, its reads ranged GETs; "wb": one upload, seen once closed."""
        if mode == "rb":
            return self.fs.open_input_file(self.key)
        if mode == "wb":
            return self.fs.open_output_stream(self.key)
        raise ValueError(f"ObjectPath.open takes 'rb' or 'wb', not {mode!r}")

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.key) as f:  # a missing key: FileNotFoundError, as for a Path
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        with self.fs.open_output_stream(self.key) as f:
            f.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a 'directory' is a prefix, there once a key lies below it."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.delete_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def replace(self, target: ObjectPath) -> ObjectPath:
        return self.rename(target)

    def rename(self, target: ObjectPath) -> ObjectPath:
        """Move a file, or every object below a prefix, to `target` (copied by the store, then deleted)."""
        from pyarrow.fs import FileSelector, FileType

        if self.is_file():
            self.fs.move(self.key, target.key)
            return target
        for info in self.fs.get_file_info(FileSelector(self.key, recursive=True)):
            if info.type == FileType.File:
                self.fs.copy_file(info.path, target.key + info.path[len(self.key):])
        self.fs.delete_dir(self.key)
        return target
