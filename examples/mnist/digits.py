"""The embedded default dataset of the MNIST examples: scikit-learn's handwritten digits
(shipped in its wheel, so nothing is downloaded), scaled to MNIST's 28x28 format."""
import numpy as np


def load_digits(val_fraction: float, seed: int):
    """scikit-learn's digits as 28x28 uint8 images, split deterministically (the same
    split on every worker): (train_images, train_labels, val_images, val_labels)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    # 8x8 pixels in 0..16 -> 24x24 by repeating each pixel 3x3, then a 2-pixel border as
    # in MNIST, whose digits sit in a 20x20 box centred in 28x28.
    images = np.kron(digits.images, np.ones((3, 3))) * (255.0 / 16.0)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round().astype(np.uint8)
    labels = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(labels))
    num_val = int(round(len(labels) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return images[train], labels[train], images[val], labels[val]
