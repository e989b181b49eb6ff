"""Package the embedded ``textenc`` demo model: seeded (untrained) weights, for benchmarks.

``python -m scripts.package_textenc``. Deterministic: the same seed and torch version give
the same weights and therefore the same version id.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY
from service.manifest import Architecture, TensorSpec
from service.models.textenc import PAD_ID, TextEncoder
from service.packaging.package import Packager

VOCABULARY = 1000
MAX_LENGTH = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=BUNDLED_MODEL_REPOSITORY)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = TextEncoder(vocab_size=VOCABULARY, max_length=MAX_LENGTH).eval()
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "textenc.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
        manifest = Packager(args.repository).package(
            name="textenc",
            artifact=weights,
            format="safetensors",
            architecture=Architecture(
                import_path="service.models.textenc:TextEncoder",
                kwargs={"vocab_size": VOCABULARY, "max_length": MAX_LENGTH},
            ),
            inputs=(
                TensorSpec(
                    name="token_ids",
                    dtype="int64",
                    shape=(-1, -1),
                    max_length=MAX_LENGTH,
                    min_value=1,
                    max_value=VOCABULARY - 1,
                    pad_value=PAD_ID,
                ),
            ),
            outputs=(TensorSpec(name="embedding", dtype="float32", shape=(-1, 256)),),
            metadata={
                "description": "Transformer encoder (width 256, 4 layers, 4 heads) over token "
                "ids 1-999 (0 is padding), 1 to 512 tokens; output: mean-pooled 256-vector.",
                "weights": f"untrained, torch.manual_seed({args.seed}); for benchmarks",
            },
        )
    print(f"textenc {manifest.version}")


if __name__ == "__main__":
    main()
