import unittest

from storage import UnsafePathError, resolve


class EscapeTest(unittest.TestCase):
    def test_sibling_with_common_prefix_rejected(self):
        with self.assertRaises(UnsafePathError):
            resolve("/srv/data", "../data-old/secret.txt")
        with self.assertRaises(UnsafePathError):
            resolve("/srv/data/", "../database.db")

    def test_absolute_rejected(self):
        with self.assertRaises(UnsafePathError):
            resolve("/srv/data", "/etc/passwd")

    def test_dotdot_back_inside(self):
        self.assertEqual(resolve("/srv/data", "a/../b/./c.txt"), "/srv/data/b/c.txt")

    def test_root_itself(self):
        self.assertEqual(resolve("/srv/data", "."), "/srv/data")
