"""The phases of tools/gpu_check.py, one module each (`run(check, options)`). Each takes the phase's Check (record, budget, work folder,
log) and the parsed options, measures items in order of importance (what the budget cuts is
the end of the list) and fills check.record["summary"] with the headline numbers (docs/GPU.md, "Reading the JSONs").

Estimates (`check.item(name, seconds, ...)`) are for one H100, generous; sizes are chosen so
that each phase takes 2-7 minutes there.
"""
