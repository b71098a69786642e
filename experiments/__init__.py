"""Experiments built on the library (model/, train/): each folder one study, run with `python -m`."""
