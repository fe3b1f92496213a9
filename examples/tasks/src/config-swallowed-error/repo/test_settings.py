import json
import os
import tempfile
import unittest

from settings import DEFAULTS, ConfigError, load


class LoadTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "service.json")

    def tearDown(self):
        self.dir.cleanup()

    def test_missing_file(self):
        self.assertEqual(load(self.path), DEFAULTS)

    def test_override(self):
        with open(self.path, "w") as f:
            json.dump({"port": 9000}, f)
        self.assertEqual(load(self.path)["port"], 9000)

    def test_not_an_object(self):
        with open(self.path, "w") as f:
            f.write("[1, 2]")
        with self.assertRaises(ConfigError):
            load(self.path)


if __name__ == "__main__":
    unittest.main()
