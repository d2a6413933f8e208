"""`--storage-path` as a path: a local directory, or an object store's URI (`s3://bucket/prefix`,
`gs://...`) as an ObjectPath over one pyarrow filesystem; what Ray Train is given for it; and the one
check, at the edge, that the store answers, in one line when it does not.

S3's endpoint comes from the URI (`s3://bucket/prefix?endpoint_override=http://host:9000`) or the
environment (AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL), its credentials from the usual AWS
variables and files. Credentials found in the driver's environment are given to the filesystem
itself, so the ranks, which Ray starts with the raylet's environment and not the driver's, write
with the same ones. With an endpoint of its own, no EC2 metadata is asked for: away from a cloud VM
that probing cost 2 to 12 s (apache/arrow#46723).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Union
from urllib.parse import parse_qsl, urlsplit

from raytrain_ddp.config import ConfigError
from raytrain_ddp.storage.object_path import ObjectPath

RunPath = Union[Path, ObjectPath]
"""Where a run's files are: a local path, or a path in an object store; both with pathlib's API."""

URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

ANSWER_S = 5.0
"""The edge check's bound: a store that has not answered in this many seconds is named in one line."""
CONNECT_S, REQUEST_S = 10.0, 60.0
"""The working filesystem's timeouts: to connect, and for a request that moves no byte."""
S3_OPTIONS = ("endpoint_override", "region", "scheme")
"""What an s3:// URI's query may set; anything else is a typo that would send the run elsewhere."""


def is_uri(storage_path: str) -> bool:
    return bool(URI.match(storage_path)) and not storage_path.startswith("file://")


def storage_root(storage_path: str, keys: bool = True, flag: str = "--storage-path") -> RunPath:
    """--storage-path as a path: local ones made absolute (the ranks do not start in the driver's
    directory), URIs on their store's filesystem. `keys=False`: a filesystem that holds no
    credentials of its own, for one that is pickled into files (Tune's state); it finds them where
    it is used. `flag`: the option its error lines name (--data-dir takes a URI too)."""
    if storage_path.startswith("file://"):
        storage_path = storage_path[len("file://"):]
    if not is_uri(storage_path):
        return Path(storage_path).expanduser().absolute()
    parts = urlsplit(storage_path)
    if "@" in parts.netloc:  # said without the keys: the line is printed, and may be logged
        shown = parts._replace(netloc="KEYS@" + parts.netloc.rsplit("@", 1)[1]).geturl()
        raise ConfigError(f"{flag} {shown}: keys in the URI would be printed and saved with the run; set "
                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or use ~/.aws) and drop them from the URI")
    key = (parts.netloc + parts.path).strip("/")
    if not parts.netloc:
        raise ConfigError(f"{flag} {storage_path} names no bucket; pass {parts.scheme}://BUCKET/PREFIX")
    if parts.scheme == "s3":
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(S3_OPTIONS))
        if unknown:
            raise ConfigError(f"{flag} {storage_path}: the URI's option {unknown[0]!r} is not one of "
                              f"{', '.join(S3_OPTIONS)}; fix its name, or drop it")
        return ObjectPath(s3_filesystem(parts.netloc, query, keys=keys, flag=flag), "s3", key)
    from pyarrow import fs

    try:
        filesystem, path = fs.FileSystem.from_uri(storage_path)
    except (ValueError, OSError, ImportError) as err:
        raise ConfigError(f"{flag} {storage_path}: {first_line(err)}; pass a local path, or an s3:// "
                          "or gs:// URI") from None
    return ObjectPath(filesystem, parts.scheme, path)


def s3_filesystem(bucket: str, query: dict[str, str], answer_s: float | None = None, keys: bool = True,
                  flag: str = "--storage-path") -> Any:
    """An S3 filesystem for `bucket`, by the URI's query and the environment (the module's doc).
    `answer_s`: a probe's, bounded by one try of that many seconds; `keys=False`: the environment's
    credentials are left to the AWS chain where the filesystem is used, not held in it."""
    try:
        from pyarrow import fs
        from pyarrow.fs import S3FileSystem
    except ImportError:
        raise ConfigError("this pyarrow was built without S3: pip install a pyarrow wheel from PyPI "
                          f"(its wheels have S3), or pass a local {flag}") from None
    endpoint = query.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options: dict[str, Any] = {}
    if endpoint:
        options["endpoint_override"] = endpoint
        options["scheme"] = query.get("scheme") or (urlsplit(endpoint).scheme if "://" in endpoint else "https")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    region = query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region is None and endpoint:
        region = "us-east-1"  # a server of its own: any region will do, and asking costs a request
    if region is None:
        try:
            region = fs.resolve_s3_region(bucket)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{flag} s3://{bucket}: cannot find the bucket's region ({first_line(err)}); "
                              "set AWS_REGION, or check the bucket's name") from None
    options["region"] = region
    if keys and os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        options.update(access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                       session_token=os.environ.get("AWS_SESSION_TOKEN"))
    if answer_s is None:
        timeouts = {"connect_timeout": CONNECT_S, "request_timeout": REQUEST_S}
    else:
        timeouts = {"connect_timeout": answer_s, "request_timeout": answer_s,
                    "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=1)}
    return S3FileSystem(**options, **timeouts)


def check_store(root: RunPath, storage_path: str, flag: str = "--storage-path") -> None:
    """That the store at `root` answers and its bucket is there, within about ANSWER_S: one line
    (ConfigError) naming the fault and its fix where not. Local paths: nothing to do here
    (preflight's check_writable writes a probe)."""
    if isinstance(root, Path):
        return
    bucket = root.key.split("/", 1)[0]
    probe = root.fs
    if root.scheme == "s3":
        parts = urlsplit(storage_path)
        probe = s3_filesystem(bucket, dict(parse_qsl(parts.query)), answer_s=ANSWER_S, flag=flag)
    from pyarrow.fs import FileType

    started = time.monotonic()
    try:
        found = probe.get_file_info(bucket).type
    except OSError as err:
        said = first_line(err)
        where = f"{flag} {root}"
        if "Timeout" in said or "timed out" in said.lower():
            raise ConfigError(f"{where}: its store did not answer in {ANSWER_S:.0f} s ({said}); check the endpoint "
                              "(AWS_ENDPOINT_URL_S3, or ?endpoint_override= in the URI)") from None
        if "ACCESS_DENIED" in said or "AccessDenied" in said or "403" in said or "InvalidAccessKeyId" in said:
            raise ConfigError(f"{where}: access denied ({said}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                              "or the credentials in ~/.aws") from None
        raise ConfigError(f"{where}: cannot reach its store after {time.monotonic() - started:.1f} s ({said}); check "
                          "the endpoint (AWS_ENDPOINT_URL_S3, or ?endpoint_override= in the URI)") from None
    if found == FileType.NotFound:
        raise ConfigError(f"{flag} {root}: there is no bucket {bucket!r} at its store; create it, or pass "
                          f"another {flag}")


def ray_storage(root: RunPath) -> dict[str, Any]:
    """RunConfig's storage for runs under `root`: a local path, or the store's path and filesystem
    (Ray Train takes `bucket/prefix` with its filesystem; the URI with one is refused)."""
    if isinstance(root, Path):
        return {"storage_path": str(root)}
    return {"storage_path": root.key, "storage_filesystem": root.fs}


def below(storage_path: str, *parts: str) -> str:
    """A storage path under another, as a string a process elsewhere can resolve again: a URI keeps
    its query (?endpoint_override=), which is part of where the store is."""
    if not is_uri(storage_path):
        return str(Path(storage_path).joinpath(*parts))
    split = urlsplit(storage_path)
    return split._replace(path="/".join([split.path.rstrip("/"), *parts])).geturl()


STORE_ENV = ("AWS_", "GOOGLE_APPLICATION_CREDENTIALS")
"""The variables an object store's client reads (endpoint, region, credentials)."""


def store_env(storage_path: str) -> dict[str, str]:
    """The driver's object-store settings, for actors that resolve the store themselves (a sweep's
    trials): a Ray worker starts with its raylet's environment, not the driver's. {} for a local path."""
    if not is_uri(storage_path):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(STORE_ENV)}


def first_line(err: BaseException) -> str:
    """An error's first line, cut to a line's length: pyarrow's S3 errors say the key, the operation
    and the cause there."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:240]
