"""The robustness fuzz suite: damaged copies of the committed fixtures (``mutations``), every command
run on each and its outcome classified (``harness``). ``make test`` runs a small budget
(``test_fuzz.py``); ``make fuzz`` a large one (``python -m tests.fuzz``)."""
