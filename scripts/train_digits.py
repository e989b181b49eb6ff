"""Train the embedded ``digits`` demo model and package it into the model repository.

Needs the training extra (scikit-learn): ``pip install -e '.[train]'``, then
``python -m scripts.train_digits``. Deterministic: the same seed gives the same weights and
therefore the same version id.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from service.config import BUNDLED_MODEL_REPOSITORY
from service.manifest import Architecture, TensorSpec
from service.models.digits import DigitsCNN
from service.packaging.package import Packager

ARCHITECTURE = Architecture(import_path="service.models.digits:DigitsCNN", kwargs={})


def load_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits data set scaled to [0, 1] as (N, 8, 8) float32, split 80/20, stratified."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    return train_x, test_x, train_y, test_y


def train(seed: int, epochs: int) -> tuple[DigitsCNN, float, int, int]:
    torch.manual_seed(seed)
    train_x, test_x, train_y, test_y = load_split(seed)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    inputs, targets = torch.from_numpy(train_x), torch.from_numpy(train_y)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(inputs), 64):
            batch = order[start : start + 64]
            optimizer.zero_grad()
            loss_fn(model(inputs[batch]), targets[batch]).backward()
            optimizer.step()
    model.eval()
    with torch.inference_mode():
        predicted = model(torch.from_numpy(test_x)).argmax(dim=1).numpy()
    accuracy = float((predicted == test_y).mean())
    return model, accuracy, len(train_x), len(test_x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=BUNDLED_MODEL_REPOSITORY)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    model, accuracy, train_size, test_size = train(args.seed, args.epochs)
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "digits.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
        manifest = Packager(args.repository).package(
            name="digits",
            artifact=weights,
            format="safetensors",
            architecture=ARCHITECTURE,
            inputs=(
                TensorSpec(
                    name="image", dtype="float32", shape=(-1, 8, 8), min_value=0.0, max_value=1.0
                ),
            ),
            outputs=(
                TensorSpec(
                    name="logits",
                    dtype="float32",
                    shape=(-1, 10),
                    labels=tuple(str(digit) for digit in range(10)),
                ),
            ),
            metadata={
                "description": "CNN over 8x8 grey-scale digits; pixel values in [0, 1] "
                "(scikit-learn's values divided by 16); output: 10 class logits.",
                "training_data": "sklearn.datasets.load_digits (UCI optical digits, 1,797 images)",
                "split": f"stratified 80/20, random_state={args.seed}",
                "train_size": train_size,
                "test_size": test_size,
                "test_accuracy": round(accuracy, 4),
                "epochs": args.epochs,
                "labels": [str(digit) for digit in range(10)],
            },
        )
    print(f"digits {manifest.version} test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
