"""Write a tiny image-classification dataset of generated pictures: coloured shapes.

Each class is one shape (circle, square, triangle, cross, ring, bar), drawn with a random
colour, size and position on a random dark background, so a small network learns it in
a few epochs. The layout is what ``train_imagenet.py --data-dir`` reads:

    python examples/imagenet/make_tiny_rec.py --output-dir data/tiny
        data/tiny/train.rec, train.idx, val.rec, val.idx   (MXNet indexed RecordIO)
    python examples/imagenet/make_tiny_rec.py --output-dir data/tiny-folder --format folder
        data/tiny-folder/train/<class>/*.png, val/<class>/*.png
"""
from __future__ import annotations

import argparse
import os

import cv2
import mxnet as mx
import numpy as np

SHAPES = ("circle", "square", "triangle", "cross", "ring", "bar")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Write a tiny dataset of generated coloured shapes as .rec/.idx files "
                    "(or an image folder) for examples/imagenet/train_imagenet.py.")
    parser.add_argument("--output-dir", required=True, help="where to write the dataset")
    parser.add_argument("--format", choices=("rec", "folder"), default="rec",
                        help="rec: train/val .rec and .idx files; folder: one directory of "
                             "PNG files per class (default: rec)")
    parser.add_argument("--classes", type=int, default=4,
                        help=f"number of classes, at most {len(SHAPES)} (default: 4)")
    parser.add_argument("--train-per-class", type=int, default=64,
                        help="training images per class (default: 64)")
    parser.add_argument("--val-per-class", type=int, default=16,
                        help="validation images per class (default: 16)")
    parser.add_argument("--size", type=int, default=32,
                        help="width and height of the images in pixels (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args(argv)
    if not 1 <= args.classes <= len(SHAPES):
        parser.error(f"--classes must be in [1, {len(SHAPES)}], got {args.classes}")
    if args.train_per_class < 1 or args.val_per_class < 1:
        parser.error("--train-per-class and --val-per-class must be at least 1")
    if args.size < 16:
        parser.error(f"--size must be at least 16, got {args.size}")
    return args


def draw(shape: str, size: int, rng: np.random.RandomState) -> np.ndarray:
    """One BGR uint8 image of ``shape``."""
    image = np.empty((size, size, 3), np.uint8)
    image[:] = rng.randint(0, 80, size=3)
    image += rng.randint(0, 30, size=image.shape).astype(np.uint8)
    colour = tuple(int(c) for c in rng.randint(120, 256, size=3))
    radius = int(size * rng.uniform(0.2, 0.35))
    cx, cy = (int(v) for v in rng.randint(radius, size - radius, size=2))
    thickness = max(1, size // 12)
    if shape == "circle":
        cv2.circle(image, (cx, cy), radius, colour, -1)
    elif shape == "square":
        cv2.rectangle(image, (cx - radius, cy - radius), (cx + radius, cy + radius), colour, -1)
    elif shape == "triangle":
        corners = np.array([(cx, cy - radius), (cx - radius, cy + radius),
                            (cx + radius, cy + radius)], np.int32)
        cv2.fillPoly(image, [corners], colour)
    elif shape == "cross":
        cv2.line(image, (cx - radius, cy), (cx + radius, cy), colour, 2 * thickness)
        cv2.line(image, (cx, cy - radius), (cx, cy + radius), colour, 2 * thickness)
    elif shape == "ring":
        cv2.circle(image, (cx, cy), radius, colour, thickness)
    else:
        cv2.rectangle(image, (cx - radius, cy - thickness), (cx + radius, cy + thickness),
                      colour, -1)
    return image


def write_rec(prefix: str, items: list) -> None:
    record = mx.recordio.MXIndexedRecordIO(prefix + ".idx", prefix + ".rec", "w")
    for index, (label, image) in enumerate(items):
        header = mx.recordio.IRHeader(flag=0, label=float(label), id=index, id2=0)
        record.write_idx(index, mx.recordio.pack_img(header, image, quality=95,
                                                     img_fmt=".png"))
    record.close()


def write_folder(root: str, items: list, classes: list) -> None:
    for index, (label, image) in enumerate(items):
        directory = os.path.join(root, classes[label])
        os.makedirs(directory, exist_ok=True)
        cv2.imwrite(os.path.join(directory, f"{index:05d}.png"), image)


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = np.random.RandomState(args.seed)
    classes = list(SHAPES[:args.classes])
    os.makedirs(args.output_dir, exist_ok=True)
    for split, per_class in (("train", args.train_per_class), ("val", args.val_per_class)):
        items = [(label, draw(shape, args.size, rng))
                 for label, shape in enumerate(classes) for _ in range(per_class)]
        order = rng.permutation(len(items))
        items = [items[i] for i in order]
        if args.format == "rec":
            write_rec(os.path.join(args.output_dir, split), items)
        else:
            write_folder(os.path.join(args.output_dir, split), items, classes)
    print(f"wrote {args.classes} classes ({', '.join(classes)}), "
          f"{args.classes * args.train_per_class} training and "
          f"{args.classes * args.val_per_class} validation images of {args.size}x{args.size} "
          f"as {args.format} to {args.output_dir}")


if __name__ == "__main__":
    main()
