"""Per-format normalisation and augmentation (torchvision transforms v2), and the Dataset that applies them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
from torch.utils.data import Dataset

from raytrain_ddp.data.batches import UNREADABLE
from raytrain_ddp.data.formats import BadSample, Samples

if TYPE_CHECKING:  # torchvision takes seconds to import: only where a worker transforms images
    from torchvision.transforms import v2


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Recipe(NamedTuple):
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool


RECIPES: dict[str, Recipe] = {
    "mnist": Recipe((0.1307,), (0.3081,), flip=False),  # a mirrored digit is not the same digit
    "cifar10": Recipe((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), flip=True),
    "tinyimagenet": Recipe(IMAGENET_MEAN, IMAGENET_STD, flip=True),
    "imagefolder": Recipe(IMAGENET_MEAN, IMAGENET_STD, flip=True),
}
"""Per source format: normalisation and whether horizontal flips keep the label."""


def augmentation(train: bool, image_size: int, native_size: int | None, flip: bool) -> v2.Transform:
    """uint8 CHW image -> uint8 CHW image of side image_size: the random, per-sample part."""
    from torchvision.transforms import v2

    if native_size is None:  # photos of any size: a random region for training, the centre for val
        steps = (
            [v2.RandomResizedCrop(image_size, scale=(0.25, 1.0), antialias=True)]
            if train
            else [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
        )
    else:  # small fixed-size images: pad-and-crop shifts keep the whole object in view
        steps = [] if image_size == native_size else [v2.Resize([image_size, image_size], antialias=True)]
        if train:
            steps.append(v2.RandomCrop(image_size, padding=image_size // 8))
    if train and flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps) if steps else v2.Identity()


def normalization(recipe: Recipe) -> v2.Transform:
    """uint8 image or batch -> float32, normalised per channel."""
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(recipe.mean, recipe.std)])


def transform_for(train: bool, image_size: int, native_size: int | None, recipe: Recipe) -> v2.Transform:
    """A split's whole transform: its augmentation, then the normalisation."""
    from torchvision.transforms import v2

    return v2.Compose([augmentation(train, image_size, native_size, recipe.flip), normalization(recipe)])


class Prepared(Dataset):
    """Samples -> (augmented, normalised image, label).

    The transform is made where the first sample is, from `make`: with loader workers, in them, so
    the rank never imports torchvision (2 s) for images it never transforms; the forkserver that
    starts them has imported it beside the rank's start (`worker_imports`, loader_workers.py).

    An unreadable sample raises BadSample naming its file, or with --skip-bad comes out as a blank
    image labelled UNREADABLE, so batches keep their shape and Batches can drop and count it.
    """

    random_streams = ("torch",)
    """Where the transforms draw from: torchvision's v2 transforms, torch's global CPU generator only."""
    worker_imports = ("torchvision.transforms.v2",)
    """What a process that makes samples imports: its loader workers' forkserver does it ahead."""

    def __init__(self, samples: Samples, make: Callable[[], v2.Transform], skip_bad: bool, shape: tuple[int, ...]):
        self.samples, self.make, self.skip_bad, self.shape = samples, make, skip_bad, shape
        self.transform: v2.Transform | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "transform": None}  # a worker makes its own from `make`

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            image, label = self.samples[index]
        except BadSample:
            if not self.skip_bad:
                raise
            return torch.zeros(self.shape), UNREADABLE
        if self.transform is None:
            self.transform = self.make()
        return self.transform(image), label
