"""Readers for the on-disk dataset formats: each turns a directory into indexable samples.

A sample is (uint8 CHW image tensor, label). Readers list files and load labels but never decode
ahead, so the driver runs the same readers to check the data in seconds before any worker starts.
A problem with the layout raises ConfigError naming the file or folder; an image that does not
decode raises BadSample naming its file, at the moment it is read.

torch is imported only where a sample is made: the driver's checks read layouts without it. The
sample containers are map-style datasets (`__len__`, `__getitem__`), as a DataLoader takes them.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

import numpy as np

from raytrain_ddp.config import ConfigError
from raytrain_ddp.data.download import DOWNLOADS, download
from raytrain_ddp.storage.location import first_line
from raytrain_ddp.storage.object_path import ObjectPath

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif")
"""What torchvision.io.decode_image reads; other files in class folders are ignored."""

# torchvision 0.29 deprecates its decoders in favour of TorchCodec, but they still work and are the
# fastest we have (2-3x PIL on small JPEGs). Say it once in the docs, not once per image.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning)

MANIFEST = "manifest.json"  # convert.MANIFEST too: convert must not import torch to start
MANIFEST_FORMAT = "raytrain-parquet/1"


class BadSample(RuntimeError):
    """An image that cannot be decoded. The message names the file (or shard and row)."""


class Samples(Protocol):
    labels: np.ndarray
    """int64 label of every sample, loaded up front (cheap) so labels can be checked early."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]: ...
    def encoded(self, index: int) -> bytes:
        """The sample as image-file bytes (what `raytrain data convert` stores)."""
    def source(self, index: int) -> str:
        """Where the sample lives, for error messages."""
    def select(self, indices: np.ndarray) -> Samples: ...


class Layout(NamedTuple):
    """One dataset as found on disk."""

    source: str
    """Which format it came from: mnist, cifar10, tinyimagenet or imagefolder (picks the transforms)."""
    train: Samples
    val: Samples | None
    """None when the data has no validation split: splits.py holds out --val-fraction of train."""
    classes: list[str]
    channels: int
    image_size: int | None
    """Side of every image when they all share one (MNIST 28, CIFAR 32, TinyImageNet 64), else None."""


# --- decoding ---

def decode(data: bytes, channels: int, source: str | Callable[[], str]) -> torch.Tensor:
    """Image-file bytes (JPEG, PNG, WebP, GIF) -> uint8 CHW tensor; BadSample names `source`.

    `source` may be a function, for names that cost a read to find: it is only called on failure.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_image

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        if not data:
            raise RuntimeError("the file is empty")
        return decode_image(torch.from_numpy(np.frombuffer(data, np.uint8).copy()), mode=mode)
    except RuntimeError as err:
        name = source() if callable(source) else source
        raise BadSample(f"cannot decode image {name}: {_reason(err)}; fix or delete it, or pass --skip-bad") from None


def encode_png(pixels: np.ndarray) -> bytes:
    """HWC uint8 pixels -> PNG bytes (lossless, for sources that store raw pixels)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(out, format="PNG")
    return out.getvalue()


def _reason(err: BaseException) -> str:
    # torchvision prefixes its messages with "function, /path/to/file.cpp:123, ".
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if re.match(r"^[\w:()]+, \S+\.cpp:\d+, ", text):
        text = re.sub(r"^[\w:()]+, \S+\.cpp:\d+, ", "", text).split(". ")[0]
    return text


# --- sample containers ---

class ArraySamples:
    """Pixels already in memory (MNIST, CIFAR-10): N x H x W x C uint8."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, origin: str):
        self.images, self.labels, self.origin = images, labels.astype(np.int64), origin

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import torch  # a name lookup once imported: the driver reads layouts without it

        return torch.from_numpy(self.images[index]).permute(2, 0, 1), int(self.labels[index])

    def encoded(self, index: int) -> bytes:
        return encode_png(self.images[index])

    def source(self, index: int) -> str:
        return f"{self.origin} #{index}"

    def select(self, indices: np.ndarray) -> ArraySamples:
        return ArraySamples(self.images[indices], self.labels[indices], self.origin)


class FileSamples:
    """One image file per sample (TinyImageNet, ImageFolder)."""

    def __init__(self, paths: list[str], labels: np.ndarray, channels: int = 3):
        self.paths, self.labels, self.channels = paths, np.asarray(labels, np.int64), channels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return decode(self.encoded(index), self.channels, self.paths[index]), int(self.labels[index])

    def encoded(self, index: int) -> bytes:
        try:
            return Path(self.paths[index]).read_bytes()
        except OSError as err:
            raise BadSample(f"cannot read {self.paths[index]}: {err.strerror}; pass --skip-bad to skip it") from None

    def source(self, index: int) -> str:
        return self.paths[index]

    def select(self, indices: np.ndarray) -> FileSamples:
        return FileSamples([self.paths[i] for i in indices], self.labels[indices], self.channels)


class ParquetSamples:
    """Rows of Parquet shards with `image` (file bytes) and `label` columns, `path` optional.

    Labels load at once; the image column loads on `load_images()`, whole, into this process. Call
    it before a DataLoader forks its workers and they share the pages. Streaming sets larger than
    memory is what --loader ray is for.
    """

    def __init__(self, files: list[Path | ObjectPath], channels: int, rows: np.ndarray | None = None, _shared=None):
        self.files, self.channels = files, channels
        if _shared is None:
            # The shards at once: on an object store each costs a few round trips, not a disk read.
            with ThreadPoolExecutor(READ_THREADS) as pool:
                columns = list(pool.map(label_column, files))
            labels = [column.to_numpy() for column in columns]
            counts = [len(column) for column in columns]
            all_labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
            _shared = {"labels": all_labels, "starts": np.cumsum([0] + counts), "images": None}
        self._shared = _shared
        self.rows = np.arange(len(_shared["labels"])) if rows is None else rows
        self.labels = _shared["labels"][self.rows]

    def load_images(self) -> ParquetSamples:
        import pyarrow as pa

        if self._shared["images"] is None:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                tables = list(pool.map(lambda f: read_columns(f, ["image"]), self.files))
            self._shared["images"] = pa.concat_tables(tables).column("image") if tables else None
        return self

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return decode(self.encoded(index), self.channels, lambda: self.source(index)), int(self.labels[index])

    def encoded(self, index: int) -> bytes:
        self.load_images()
        return self._shared["images"][int(self.rows[index])].as_py()

    def source(self, index: int) -> str:
        row = int(self.rows[index])
        k = int(np.searchsorted(self._shared["starts"], row, side="right")) - 1
        row_in_file = row - int(self._shared["starts"][k])
        try:
            origin = read_columns(self.files[k], ["path"]).column("path")[row_in_file]
        except Exception:  # no path column: the shard and row are all we know
            return f"{self.files[k]} row {row_in_file}"
        return f"{self.files[k]} row {row_in_file} (from {origin})"

    def select(self, indices: np.ndarray) -> ParquetSamples:
        return ParquetSamples(self.files, self.channels, self.rows[indices], self._shared)


READ_THREADS = 8
"""Shards read at once by a ParquetSamples: pyarrow reads without the GIL, and an object store's
latency, not its bandwidth, bounds a read of one small column."""


def read_columns(shard: Path | ObjectPath, columns: list[str]) -> pa.Table:
    """Columns of one shard, on disk or on an object store (through its filesystem)."""
    import pyarrow.parquet as pq

    if isinstance(shard, ObjectPath):
        return pq.read_table(shard.key, columns=columns, filesystem=shard.fs)
    return pq.read_table(shard, columns=columns)


def label_column(shard: Path | ObjectPath) -> pa.ChunkedArray:
    try:
        return read_columns(shard, ["label"]).column("label")
    except Exception as err:  # ArrowInvalid, OSError, KeyError: all mean "not our shard", but on a store
        if isinstance(shard, ObjectPath) and isinstance(err, OSError):  # the store's fault (gone, denied)
            raise ConfigError(f"cannot read {shard} ({first_line(err)}); check that its store serves it") from None
        raise ConfigError(
            f"cannot read the label column of {shard} ({_reason(err)}); rewrite the shards with `raytrain data convert`"
        ) from None


# --- MNIST: idx files, torchvision's layout <root>/MNIST/raw/*-ubyte[.gz] ---

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def mnist_dir(root: Path) -> Path:
    return root / "MNIST" / "raw"


def read_mnist(root: Path) -> Layout:
    raw = mnist_dir(root) if mnist_dir(root).is_dir() else root  # idx files straight in --data-dir work too
    splits = {}
    for split, (image_name, label_name) in MNIST_FILES.items():
        images_path, labels_path = _find_idx(raw, image_name), _find_idx(raw, label_name)
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise ConfigError(f"{images_path} must hold N x H x W images and {labels_path} N labels")
        if len(images) != len(labels):
            raise ConfigError(
                f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels; "
                "download them again (--download)"
            )
        splits[split] = ArraySamples(images[..., None], labels, str(labels_path))
    return Layout("mnist", splits["train"], splits["val"], [str(i) for i in range(10)], 1, 28)


def _find_idx(folder: Path, name: str) -> Path:
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    raise ConfigError(
        f"MNIST file {name}[.gz] not found in {folder}; pass --download, or copy the four idx files "
        "there (torchvision's layout: <data-dir>/MNIST/raw/)"
    )


def read_idx(path: Path) -> np.ndarray:
    """An idx file (the MNIST format), plain or gzipped, checked against its own header."""
    try:
        data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as err:
        raise ConfigError(f"cannot read {path} ({err}); download it again (--download)") from None
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise ConfigError(f"{path} is not an idx file of uint8 (bad magic number); download it again")
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, ">i4", count=ndim, offset=4))
    expected = 4 + 4 * ndim + int(np.prod(dims))
    if len(data) != expected:
        raise ConfigError(
            f"{path} is truncated or corrupt: its header promises {expected} bytes, it has {len(data)}; "
            "download it again (--download)"
        )
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()


# --- CIFAR-10: python pickle batches, torchvision's layout <root>/cifar-10-batches-py/ ---

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR10_VAL = ["test_batch"]
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def read_cifar10(root: Path) -> Layout:
    base = root if (root / CIFAR10_TRAIN[0]).exists() else root / CIFAR10_DIR
    train, val = (_cifar_batches(base, names) for names in (CIFAR10_TRAIN, CIFAR10_VAL))
    classes = CIFAR10_CLASSES
    if (base / "batches.meta").exists():
        classes = list(_unpickle(base / "batches.meta").get("label_names", classes))
    return Layout("cifar10", train, val, classes, 3, 32)


def _cifar_batches(base: Path, names: list[str]) -> ArraySamples:
    images, labels = [], []
    for name in names:
        path = base / name
        if not path.is_file():
            raise ConfigError(
                f"CIFAR-10 batch {path} not found; pass --download, or extract cifar-10-python.tar.gz "
                f"into --data-dir (torchvision's layout: <data-dir>/{CIFAR10_DIR}/)"
            )
        batch = _unpickle(path)
        try:
            pixels = np.asarray(batch["data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            batch_labels = np.asarray(batch["labels"], np.int64)
        except (KeyError, ValueError) as err:
            raise ConfigError(f"{path} is not a CIFAR-10 batch ({_reason(err)}); download it again") from None
        if len(pixels) != len(batch_labels):
            raise ConfigError(f"{path} has {len(pixels)} images but {len(batch_labels)} labels; download it again")
        images.append(pixels)
        labels.append(batch_labels)
    origin = str(base / names[0]) if len(names) == 1 else f"{base}/{{{','.join(names)}}}"
    return ArraySamples(np.concatenate(images), np.concatenate(labels), origin)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            # The batches are Python 2 pickles; latin1 keeps their byte strings intact.
            return pickle.load(f, encoding="latin1")
    except Exception as err:  # UnpicklingError, EOFError (truncated), OSError
        raise ConfigError(f"cannot unpickle {path} ({type(err).__name__}: {err}); download it again") from None


# --- TinyImageNet: the official tiny-imagenet-200 layout ---

TINYIMAGENET_DIR = "tiny-imagenet-200"


def read_tinyimagenet(root: Path) -> Layout:
    base = root if (root / "wnids.txt").exists() else root / TINYIMAGENET_DIR
    wnids_file = base / "wnids.txt"
    if not wnids_file.is_file():
        raise ConfigError(
            f"no wnids.txt in {root} or {root / TINYIMAGENET_DIR}; pass --download, or unzip "
            "tiny-imagenet-200.zip into --data-dir"
        )
    wnids = sorted(set(wnids_file.read_text().split()))
    if not wnids:
        raise ConfigError(f"{wnids_file} lists no classes")
    index = {w: i for i, w in enumerate(wnids)}
    paths, labels = [], []
    for wnid in wnids:
        folder = base / "train" / wnid / "images"
        found = _images_in(folder)
        paths += found
        labels += [index[wnid]] * len(found)
    train = FileSamples(paths, np.array(labels))

    annotations = base / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise ConfigError(f"{annotations} not found; the TinyImageNet val split needs it (re-extract the zip)")
    paths, labels = [], []
    for number, line in enumerate(annotations.read_text().splitlines(), start=1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2 or fields[1] not in index:
            raise ConfigError(f"{annotations} line {number}: class {fields[1:2]} is not in {wnids_file}")
        path = base / "val" / "images" / fields[0]
        if not path.is_file():
            raise ConfigError(f"{annotations} line {number} names {path}, which does not exist")
        paths.append(str(path))
        labels.append(index[fields[1]])
    if not paths:
        raise ConfigError(f"{annotations} lists no images")
    return Layout("tinyimagenet", train, FileSamples(paths, np.array(labels)), wnids, 3, 64)


# --- ImageFolder: <root>/train/<class>/*.jpg (and val/), or <root>/<class>/*.jpg ---

def read_imagefolder(root: Path) -> Layout:
    if not root.is_dir():
        raise ConfigError(f"--data-dir {root} is not a directory")
    train_dir = root / "train" if (root / "train").is_dir() else root
    classes = _class_folders(train_dir)
    if not classes:
        hint = f"{train_dir}/<class>/<image>.jpg" + ("" if train_dir != root else f" or {root}/train/<class>/...")
        empty = "is empty" if not any(root.iterdir()) else "has no class folders"
        raise ConfigError(f"{train_dir} {empty}; expected {hint}")
    train = _folder_samples(train_dir, classes, classes)
    val = None
    if train_dir != root and (root / "val").is_dir():
        val_classes = _class_folders(root / "val")
        unknown = sorted(set(val_classes) - set(classes))
        if unknown:
            raise ConfigError(f"{root / 'val' / unknown[0]} is a class folder with no match in {train_dir}")
        if not val_classes:
            raise ConfigError(f"{root / 'val'} has no class folders; remove it to split off --val-fraction instead")
        val = _folder_samples(root / "val", val_classes, classes)
    return Layout("imagefolder", train, val, classes, 3, None)


def _class_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _folder_samples(folder: Path, names: list[str], classes: list[str]) -> FileSamples:
    paths, labels = [], []
    for name in names:
        found = _images_in(folder / name, recursive=True)
        paths += found
        labels += [classes.index(name)] * len(found)
    return FileSamples(paths, np.array(labels))


def _images_in(folder: Path, recursive: bool = False) -> list[str]:
    if not folder.is_dir():
        raise ConfigError(f"class folder {folder} does not exist")
    pattern = "**/*" if recursive else "*"
    found = sorted(str(p) for p in folder.glob(pattern) if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not found:
        raise ConfigError(
            f"class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}); add some or remove the folder"
        )
    return found


# --- Parquet shards written by `raytrain data convert` ---

def read_manifest(root: Path | ObjectPath) -> dict:
    path = root / MANIFEST
    try:
        there = path.is_file()
        text = path.read_text() if there else ""
    except OSError as err:
        raise ConfigError(f"cannot read {path} ({first_line(err)}); check --data-dir") from None
    if not there and isinstance(root, ObjectPath):
        raise ConfigError(
            f"no {MANIFEST} in {root}; write Parquet shards there with `raytrain data convert SRC {root} --format ...`, "
            "or pass the --data-dir that holds them"
        )
    if not there:
        raise ConfigError(
            f"no {MANIFEST} in {root}; write Parquet shards with `raytrain data convert SRC {root} --format ...`"
        )
    try:
        manifest = json.loads(text)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}")
        for split in ("train", "val"):
            manifest["splits"][split]["files"]
        manifest["classes"], manifest["channels"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} is not a raytrain manifest ({err}); rewrite it with `raytrain data convert`") from None
    return manifest


def parquet_files(root: Path | ObjectPath, manifest: dict, split: str) -> list[Path | ObjectPath]:
    files = [root / f for f in manifest["splits"][split]["files"]]
    # One listing per folder, not a look per shard: on an object store each look is a round trip.
    there = {str(f) for folder in {f.parent for f in files} if folder.is_dir() for f in folder.iterdir()}
    for f in files:
        if str(f) not in there:
            raise ConfigError(f"{f} is listed in {root / MANIFEST} but missing; run `raytrain data convert` again")
    if not files:
        raise ConfigError(f"{root / MANIFEST} lists no {split} shards")
    return files


def read_parquet(root: Path | ObjectPath) -> Layout:
    manifest = read_manifest(root)
    channels = int(manifest["channels"])
    train, val = (ParquetSamples(parquet_files(root, manifest, s), channels) for s in ("train", "val"))
    size = manifest.get("image_size")
    return Layout(manifest.get("source", "imagefolder"), train, val, list(manifest["classes"]), channels, size)


READERS: dict[str, Callable[[Path], Layout]] = {
    "mnist": read_mnist,
    "cifar10": read_cifar10,
    "tinyimagenet": read_tinyimagenet,
    "imagefolder": read_imagefolder,
    "parquet": read_parquet,
}
"""The datasets read from --data-dir."""


def read_layout(dataset: str, root: Path | ObjectPath, fetch: bool) -> Layout:
    """A built-in dataset's files under `root`; with `fetch` (--download), downloaded first where
    they are not there yet."""
    if fetch and dataset not in DOWNLOADS:
        raise ConfigError(f"{dataset} has no public source to download; drop --download")
    try:
        return READERS[dataset](root)
    except ConfigError:
        if not fetch:
            raise
        download(dataset, root)
        return READERS[dataset](root)
