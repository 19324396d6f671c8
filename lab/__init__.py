"""A two-hour lab on the three methods: the sheet (lab/sheet.md), the exercises (lab/exercises.py, solved),
their grader (python -m lab.check) and the side-by-side diffs of the method files (python -m lab.diffs)."""
