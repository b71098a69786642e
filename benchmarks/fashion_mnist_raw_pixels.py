"""Raw-pixel baselines on Fashion-MNIST's test split: what a classifier on the pixels alone scores,
for scale beside the frozen features of pretrained encoders (the study's report, the demo).

    python benchmarks/fashion_mnist_raw_pixels.py [--src runs/fashion-mnist] [--out benchmarks/results]

- 5-NN: Euclidean distance on pixels in [0, 1], the 5 nearest of the 60,000 training images, one
  vote each (ties to the lowest class), top-1 on the 10,000 test images;
- logistic regression: multinomial, on pixels in [0, 1], L2 penalty as scikit-learn's default
  (C = 1: 0.5 ||W||^2 + sum of losses, here divided by the sample count), fitted full-batch by
  L-BFGS in float64 to convergence (at most 500 iterations).
Both are deterministic. The record goes to <out>/raw_pixels_fashion_mnist_cpu.json with the
device, versions and commit. The idx files come from --src, else the folder data/fashion_mnist.py
finds (Debian's dataset-fashion-mnist, else runs/fashion-mnist).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from data.image_datasets import _find, read_idx

REPO = Path(__file__).resolve().parents[1]


def load(src: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx(_find(src, f"{prefix}-images-idx3-ubyte"))  # gzipped or not; a missing file is named
    labels = read_idx(_find(src, f"{prefix}-labels-idx1-ubyte"))
    return (torch.from_numpy(images.reshape(len(images), -1).astype("float64") / 255),
            torch.from_numpy(labels.astype("int64")))


def knn_5(xtr, ytr, xte, yte, k: int = 5, chunk: int = 1000) -> float:
    correct = 0
    for i in range(0, len(xte), chunk):
        nearest = torch.cdist(xte[i:i + chunk], xtr).topk(k, largest=False).indices
        votes = torch.zeros(len(nearest), 10, dtype=torch.float64).scatter_add_(
            1, ytr[nearest], torch.ones(nearest.shape, dtype=torch.float64))
        correct += (votes.argmax(1) == yte[i:i + chunk]).sum().item()
    return 100.0 * correct / len(xte)


def logistic_regression(xtr, ytr, xte, yte, max_iter: int = 500) -> float:
    head = torch.nn.Linear(xtr.shape[1], 10).double()
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), lr=1, max_iter=max_iter, history_size=20,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12)
    penalty = 1 / (2 * len(xtr))  # C = 1, the loss averaged instead of summed

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(head(xtr), ytr) + penalty * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return 100.0 * (head(xte).argmax(1) == yte).double().mean().item()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=None, help="folder of the four idx files (default: found as the demo finds them)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the record goes (default: %(default)s)")
    a = p.parse_args(argv)
    if a.src is None:
        from data.fashion_mnist import find_or_download
        a.src = find_or_download()
    from train.bench import cpu_name, versions
    from train.run.folder import git_commit

    xtr, ytr = load(a.src, "train")
    xte, yte = load(a.src, "t10k")
    t0 = time.perf_counter()
    record = {"what": "raw-pixel baselines on Fashion-MNIST's test split (benchmarks/fashion_mnist_raw_pixels.py)",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_commit(),
              "device": cpu_name(), "versions": versions(), "train_images": len(xtr), "test_images": len(xte),
              "knn_5_top1": round(knn_5(xtr, ytr, xte, yte), 2),
              "logistic_regression_top1": round(logistic_regression(xtr, ytr, xte, yte), 2)}
    record["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "raw_pixels_fashion_mnist_cpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("knn_5_top1", "logistic_regression_top1", "seconds")}))
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
