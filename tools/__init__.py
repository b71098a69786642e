"""The GPU validation kit (tools/gpu_check.py) and its helpers."""
