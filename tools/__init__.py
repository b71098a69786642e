"""The GPU validation kit (tools/gpu_check.py) and the measuring tools beside it."""
