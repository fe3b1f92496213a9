import os
import tempfile
import unittest

from settings import DEFAULTS, ConfigError, load


class BrokenFileTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "broken.json")

    def tearDown(self):
        self.dir.cleanup()

    def write(self, text):
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(text)

    def test_invalid_json_raises(self):
        self.write('{"port": 9000,}')
        with self.assertRaises(ConfigError) as caught:
            load(self.path)
        self.assertIn("broken.json", str(caught.exception))

    def test_empty_file_raises(self):
        self.write("")
        with self.assertRaises(ConfigError):
            load(self.path)

    def test_missing_file_still_defaults(self):
        self.assertEqual(load(os.path.join(self.dir.name, "nope.json")), DEFAULTS)

    def test_valid_file_merged(self):
        self.write('{"debug": true}')
        self.assertEqual(load(self.path), {**DEFAULTS, "debug": True})
