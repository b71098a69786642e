"""train/run/command.py: the training commands' --help and a bad value answer before the run's
machinery (train/run/trainer.py: the data pipeline with torchvision and timm, the engines with
torch.distributed.checkpoint) is imported, also beside the exit statuses' module the commands
import first (train/run/cli.py); a configuration that parses is handed to a run."""
import json
import subprocess
import sys

from conftest import CPU_DS, REPO

CHILD = """
import json, sys
from train.config.errors import ConfigError
from train.run.cli import run_script  # what the commands import first
from train.run.command import main
heavy = ("train.run.trainer", "torchvision", "timm", "train.engine.core", "torch.distributed.checkpoint")
seen = {}
try:
    main(["--help"])
except SystemExit as e:
    seen["help"] = [e.code, [m for m in heavy if m in sys.modules]]
try:
    main(["--ds_config", sys.argv[1], "--run.max_steps", "-3"])
except ConfigError as e:
    seen["bad value"] = ["run.max_steps" in str(e), [m for m in heavy if m in sys.modules]]
print(json.dumps(seen))
"""


def test_help_and_a_bad_value_answer_without_loading_the_run():
    proc = subprocess.run([sys.executable, "-c", CHILD, str(CPU_DS)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"help": [0, []], "bad value": [True, []]}
