"""The course's harness: how it times, judges, launches and shows, not what a chapter teaches.

- ``timing``: benchmarks that take turns, noise bands, other programs' load;
- ``verdicts``: ``check`` and its relatives, the ✓/✗ lines nbval compares;
- ``launch``, ``fast_start``: scripts and checks run in their own processes
  from a notebook, and their results read back;
- ``devices``: which devices a run uses, the same way in every process;
- ``notebook``, ``plotting``: a chapter's set-up and its figures.

The helpers that chapters teach with sit one level up, a module per topic
(``companion.hardware``, ``companion.profiling``, ``companion.memory``,
``companion.gpt``, ``companion.comm_costs``, ...), with ``companion.doctor``,
which readers run (``python -m companion.doctor``); the
scripts a reader copies are in ``companion/scripts``, and the course's
measurements around them in ``companion/checks``.
"""
