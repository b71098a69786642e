"""The phases of tools/gpu_check.py, one module each (`run(check, options)`). Each takes the phase's
Check (record, budget, work folder, log) and the parsed options, measures items in order of
importance, the items of its targets first (what the budget cuts is the end of the list), and
fills check.record["summary"] with the headline numbers (docs/GPU.md, "Reading the JSONs").

Estimates (`check.item(name, seconds, ...)`) are seconds on one H100, generous, each module saying
which committed record (benchmarks/results/) they come from; sizes are chosen so that each phase
takes 2-7 minutes there. tests/tools/test_gpu_check_plan.py plays docs/GPU.md's one call with
every item taking its whole estimate.
"""
