import unittest

from combos import subsets_of_size


class CombosTest(unittest.TestCase):
    def test_size_larger_than_input(self):
        self.assertEqual(subsets_of_size("ab", 3), [])


if __name__ == "__main__":
    unittest.main()
