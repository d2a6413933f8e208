"""Downloads of the datasets that have a public source, into --data-dir."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from raytrain_ddp.config import ConfigError

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINYIMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


def _download_mnist(root: Path) -> None:
    from torchvision.datasets import MNIST

    MNIST(str(root), train=True, download=True)  # fetches all four idx files, checks their md5


def _download_cifar10(root: Path) -> None:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)


def _download_tinyimagenet(root: Path) -> None:
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(TINYIMAGENET_URL, str(root), md5=TINYIMAGENET_MD5)


DOWNLOADS: dict[str, Callable[[Path], None]] = {
    "mnist": _download_mnist,
    "cifar10": _download_cifar10,
    "tinyimagenet": _download_tinyimagenet,
}


def download(dataset: str, root: Path) -> None:
    print(f"downloading {dataset} into {root} ...", file=sys.stderr)
    try:
        root.mkdir(parents=True, exist_ok=True)
        DOWNLOADS[dataset](root)
    except Exception as err:  # URLError, RuntimeError (md5, all mirrors failed), OSError
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(err).__name__
        raise ConfigError(
            f"cannot download {dataset} into {root} ({reason}); without network, copy the files there "
            "yourself and drop --download"
        ) from None
