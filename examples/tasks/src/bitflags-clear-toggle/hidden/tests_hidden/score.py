"""Runs the hidden tests and prints the fraction that passed; the last line is the reward."""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

suite = unittest.defaultTestLoader.discover(HERE, top_level_dir=ROOT)
result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
total = result.testsRun
failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
print(round((total - failed) / total, 4) if total else 0.0)
