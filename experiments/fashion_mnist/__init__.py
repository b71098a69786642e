"""Fashion-MNIST on the mini ViT: the demo (one method, `python -m experiments.fashion_mnist.demo`) and
the study (every method, several seeds, docs/RESULTS.md: `python -m experiments.fashion_mnist.study`)."""
