import unittest

from bits import clear_bit, get_bit, is_power_of_two, popcount, set_bit


class BitsTest(unittest.TestCase):
    def test_set_and_get(self):
        value = set_bit(set_bit(0, 0), 5)
        self.assertEqual(value, 33)
        self.assertTrue(get_bit(value, 5))
        self.assertFalse(get_bit(value, 4))

    def test_clear_lowest(self):
        self.assertEqual(clear_bit(0b111, 0), 0b110)

    def test_popcount(self):
        self.assertEqual(popcount(0b1011), 3)

    def test_powers_of_two(self):
        self.assertTrue(is_power_of_two(64))
        self.assertFalse(is_power_of_two(0))
        self.assertFalse(is_power_of_two(6))


if __name__ == "__main__":
    unittest.main()
