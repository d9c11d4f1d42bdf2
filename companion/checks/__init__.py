"""The course's checks of its scripts: measurements, formulas and verdicts.

Each file here is a program that chapters launch like a script (with
``companion.launch("checks/NAME.py", ...)``, under torchrun). It imports the
script it checks (``from companion.scripts import fsdp_gpt``) and calls that
script's own functions, so that what is checked is what a reader copies; the
counting, the formulas and the judging live here and in ``companion``, not in
the script. ``_shared.py`` holds what every check needs (tolerances, clocks,
gathering, one ending); it is not a check.
"""
