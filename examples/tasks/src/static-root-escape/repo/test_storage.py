import unittest

from storage import UnsafePathError, resolve


class ResolveTest(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(resolve("/srv/data", "css/site.css"), "/srv/data/css/site.css")

    def test_parent_rejected(self):
        with self.assertRaises(UnsafePathError):
            resolve("/srv/data", "../etc/passwd")


if __name__ == "__main__":
    unittest.main()
