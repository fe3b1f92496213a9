"""Runs sealed unittest tests (corral.rollout.observations) and prints what they observed.

Copied into the sandbox next to the sealed tests and run as `python3 -I <dir>/run_observations.py`.
Standard library only. It first prints "corral-observations <nonce>", a random token drawn before
any code under test is imported, then per observation "<nonce> <test id>#<n>\\t<repr>", and
"<nonce> <test id>#end\\t'ok'" when a test ran to its end. The daemon reads only lines carrying the
first line's token, so lines printed by code under test (which never learns it) count for nothing,
and compares the values with expected ones the sandbox never sees. Nothing here decides a reward.
"""

import os
import secrets
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _emitter():
    """Writes observations to the original stdout (kept before any test code runs, so code under
    test that rebinds sys.stdout cannot swallow them), each with a token only this closure holds."""
    out, nonce, counts = os.dup(1), secrets.token_hex(16), {}
    os.write(out, ("corral-observations " + nonce + "\n").encode())

    def emit(key, value):
        line = nonce + " " + key + "\t" + repr(value).replace("\n", "\\n") + "\n"
        os.write(out, line.encode("utf-8", "backslashreplace"))

    def observe(case, value):
        counts[case.id()] = counts.get(case.id(), 0) + 1
        emit(case.id() + "#" + str(counts[case.id()]), value)

    return emit, observe


_emit, _observe = _emitter()


class _ObserveRaises:
    def __init__(self, case, expected):
        self.case, self.expected, self.exception = case, expected, None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        self.exception = error
        if error is None:
            _observe(self.case, "no exception")
        elif isinstance(error, self.expected):
            _observe(self.case, "raised")
        else:
            _observe(self.case, "raised " + type(error).__name__)
        return error is None or isinstance(error, Exception)


class _Result(unittest.TextTestResult):
    def addSuccess(self, test):
        super().addSuccess(test)
        _emit(test.id() + "#end", "ok")


def main():
    unittest.TestCase.observe = _observe
    unittest.TestCase.observe_raises = lambda self, expected: _ObserveRaises(self, expected)
    sys.path.insert(0, ROOT)
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=ROOT)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Result).run(suite)
    # Only for people and the task build (the daemon never reads it): 1 when a test failed.
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
