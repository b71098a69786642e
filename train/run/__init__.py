"""One run from start to stop: the checks before start, building the objective and engine, the
loop, checkpoints and figures on the way, evaluation, stop signals and requeue, the run folder,
the exit statuses of the commands. Imports every other room of train/ (config, engine, weights,
estimate); the commands at train/'s top import it.

    command.py            the command's front: --help, --dry-run, parsing; the run's machinery loads after
    trainer.py            one run: check_before_start, then the Trainer: process group, engine, resume, loop,
                          export
    prestart.py           check_before_start: every check that can reject the input, before anything starts
    build.py              the objective and engine of a run, its data stream, the resume's checks
    loop.py               the one training loop: micro-batches, steps, reads at log steps
    folder.py             the run folder: config, metrics, TensorBoard, resume records
    evaluation.py         frozen-feature kNN and linear probe, a classifier's accuracy, on labeled shards
    cli.py                the exit statuses every command shares
    preemption.py         stop signals: the ranks agree, checkpoint, requeue; early_signals.py
                          catches them from a script's first line
    compile_watch.py      what run.compile compiled, read at log steps
    capture_readiness.py  whether a step could be captured as a CUDA graph (on the meta device)
    chance_loss.py, visualize.py, code_version.py: a loss at chance, the figures, which code ran
"""
