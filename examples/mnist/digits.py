"""The embedded default dataset of the MNIST examples: the 1,797 handwritten digits
bundled with scikit-learn (8x8 pixels in 0..16; E. Alpaydin and C. Kaynak, "Optical
Recognition of Handwritten Digits", UCI Machine Learning Repository, CC BY 4.0), copied
into ``digits.npz`` beside this file so that nothing is downloaded and scikit-learn is
not needed (MXNet imports it at start-up when it is installed, which costs every
process a second), scaled to MNIST's 28x28 format."""
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "digits.npz"


def load_digits(val_fraction: float, seed: int):
    """The digits as 28x28 uint8 images, split deterministically (the same split on
    every worker): (train_images, train_labels, val_images, val_labels)."""
    with np.load(DATA) as data:
        pixels, labels = data["images"].astype(np.float64), data["labels"].astype(np.int32)
    # 8x8 pixels in 0..16 -> 24x24 by repeating each pixel 3x3, then a 2-pixel border as
    # in MNIST, whose digits sit in a 20x20 box centred in 28x28.
    images = np.kron(pixels, np.ones((3, 3))) * (255.0 / 16.0)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round().astype(np.uint8)
    order = np.random.RandomState(seed).permutation(len(labels))
    num_val = int(round(len(labels) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return images[train], labels[train], images[val], labels[val]
