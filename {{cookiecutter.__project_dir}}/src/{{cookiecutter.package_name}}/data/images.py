"""Image files in class folders (``data=images``): ``train_dir/<class>/*.png`` and
``val_dir/<class>/*.png``, torchvision's ``ImageFolder`` layout (classes are the
sorted folder names). Files are read with Pillow as grayscale (``channels: 1``) or
RGB (``channels: 3``), resized to ``image_size``, scaled to [0, 1], augmented
(training only) by the transforms of ``augment`` and normalised by ``mean``/``std``.

``augment`` is a list of callables on one (C, H, W) tensor: kornia's augmentations
with ``keepdim: true`` (the default config), or torchvision's ``transforms.v2`` where
torchvision imports. Their random draws need no care: the engine makes each sample's
a function of (seed, epoch, index), so a resumed run is bit-exact (docs/data.md).

The example: with ``train_dir`` unset, the packaged digits written once as 8x8 PNGs
under ``.cache/digit_images`` (``write_digit_images``). ``predict.py files=...``
classifies new files with the run's preprocessing (``image_files``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..contract import LOADER_KEYS, ConfigError, DataLoaders, locked, make_loaders, require
from .digits import load_digits

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class Preprocess:
    """A file to a normalised (C, H, W) float tensor: what training did, and what
    prediction must do again (its keys are the data config's)."""

    def __init__(
        self,
        channels: int = 1,
        image_size: int | Sequence[int] | None = None,
        mean: Sequence[float] = (0.5,),
        std: Sequence[float] = (0.5,),
    ) -> None:
        require("data.channels", channels, channels in (1, 3), "1 (grayscale) or 3 (RGB)")
        size = [image_size] * 2 if isinstance(image_size, int) else image_size
        require(
            "data.image_size",
            image_size,
            size is None or (len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)),
            "null (as the files are), an integer (square) or [height, width]",
        )
        for key, values in (("mean", mean), ("std", std)):
            require(
                f"data.{key}",
                values,
                len(values) in (1, channels) and all(isinstance(v, int | float) for v in values),
                f"a list of 1 or {channels} numbers (one per channel)",
            )
        require("data.std", std, all(v > 0 for v in std), "numbers > 0")
        self.channels, self.size = channels, None if size is None else tuple(size)
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1)

    def load(self, path: Path) -> torch.Tensor:
        """The file as a (C, H, W) float tensor in [0, 1], resized."""
        from PIL import Image  # the vision extra

        with Image.open(path) as image:
            image = image.convert("L" if self.channels == 1 else "RGB")
            if self.size is not None and image.size != (self.size[1], self.size[0]):
                image = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            height, width = image.size[1], image.size[0]
        return pixels.view(height, width, self.channels).permute(2, 0, 1).float() / 255

    def normalise(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class ImageFiles(Dataset):
    """``(image, class index)`` per file; the index is -1 for unlabelled files."""

    def __init__(
        self,
        files: list[tuple[Path, int]],
        classes: list[str],
        preprocess: Preprocess,
        augment: Sequence[Callable[[torch.Tensor], torch.Tensor]] = (),
    ) -> None:
        self.files, self.classes, self.preprocess = files, classes, preprocess
        self.augment = list(augment)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def paths(self) -> list[Path]:
        return [path for path, _ in self.files]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.files[index]
        image = self.preprocess.load(path)
        for transform in self.augment:
            image = transform(image)
        return self.preprocess.normalise(image), torch.tensor(label)


def class_folders(root: Path, key: str) -> list[str]:
    """The class names under ``root`` (its sub-folders holding images), sorted."""
    if not root.is_dir():
        raise ConfigError(f"{key}={str(root)!r} is not allowed: no such folder")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and _images_in(d))
    if not classes:
        raise ConfigError(
            f"{key}={str(root)!r} is not allowed: it has no class folders with images "
            f"({', '.join(EXTENSIONS)}); expected {root}/<class name>/<file>"
        )
    return classes


def labelled_files(root: Path, classes: list[str], key: str) -> list[tuple[Path, int]]:
    found = [d.name for d in root.iterdir() if d.is_dir() and _images_in(d)]
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ConfigError(
            f"{key}={str(root)!r} is not allowed: its classes {unknown} are not among the "
            f"training classes {classes}"
        )
    index = {name: i for i, name in enumerate(classes)}
    return [(p, index[name]) for name in sorted(found) for p in _images_in(root / name)]


def images(
    batch_size: int,
    seed: int,
    train_dir: str | None = None,
    val_dir: str | None = None,
    channels: int = 1,
    image_size: int | Sequence[int] | None = None,
    mean: Sequence[float] = (0.5,),
    std: Sequence[float] = (0.5,),
    augment: Sequence[Callable[[torch.Tensor], torch.Tensor]] = (),
    val_fraction: float = 0.2,
    split_seed: int = 0,
    cache_dir: str = ".cache",
    val_batch_size: int = 512,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Loaders over class folders. ``val_dir`` null: a fixed ``val_fraction`` of the
    training files (``split_seed``). ``train_dir`` null: the example digits."""
    require(
        "data.val_fraction",
        val_fraction,
        isinstance(val_fraction, int | float) and 0 < val_fraction < 1,
        "a number between 0 and 1 (exclusive)",
    )
    augment = list(augment or ())
    for i, transform in enumerate(augment):
        require(f"data.augment[{i}]", transform, callable(transform), "a transform (a callable)")
    preprocess = Preprocess(channels, image_size, mean, std)
    if train_dir is None:
        train_dir = str(write_digit_images(Path(cache_dir) / "digit_images"))
    train_root = Path(train_dir)
    classes = class_folders(train_root, "data.train_dir")
    train_files = labelled_files(train_root, classes, "data.train_dir")
    if val_dir is not None:
        val_files = labelled_files(Path(val_dir), classes, "data.val_dir")
    else:
        order = torch.randperm(
            len(train_files), generator=torch.Generator().manual_seed(split_seed)
        ).tolist()
        n_val = round(len(train_files) * val_fraction)
        val_files = [train_files[i] for i in order[:n_val]]
        train_files = [train_files[i] for i in order[n_val:]]
    return make_loaders(
        ImageFiles(train_files, classes, preprocess, augment),
        ImageFiles(val_files, classes, preprocess),
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


# Loader keys may change on resume; so may the folders' location (the same files).
images.resume_may_change = (*LOADER_KEYS, "train_dir", "val_dir", "cache_dir")


def image_files(paths: Sequence[str], data: Any) -> ImageFiles:
    """Unlabelled files (a list of paths; a folder is its images) with the
    preprocessing of a run's data config (``data``: its keys); classes come from
    the run (predict.py)."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files.extend(_images_in(path))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"files={given!r} is not allowed: no such file or folder")
    if not files:
        raise ConfigError(
            f"files={list(paths)!r} is not allowed: no images ({', '.join(EXTENSIONS)})"
        )
    keys = {k: data[k] for k in ("channels", "image_size", "mean", "std") if k in data}
    return ImageFiles([(f, -1) for f in files], [], Preprocess(**keys))


images.files = image_files  # predict.py files=...: new files, the run's preprocessing


def write_digit_images(root: Path) -> Path:
    """The packaged digits as 8x8 grayscale PNGs in ``root/<digit>/NNNN.png``, written
    once (one process of a launch writes, the others wait; a finished set is marked
    by ``root/.complete``)."""
    from PIL import Image  # the vision extra

    root = root.resolve()
    with locked(root.parent / f".{root.name}.lock"):
        if (root / ".complete").exists():
            return root
        images_, labels = load_digits()
        pixels = (images_[:, 0] * 255).round().to(torch.uint8).numpy()
        for i, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
            folder = root / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i:04d}.png")
        (root / ".complete").touch()
    return root


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in EXTENSIONS and p.is_file())
