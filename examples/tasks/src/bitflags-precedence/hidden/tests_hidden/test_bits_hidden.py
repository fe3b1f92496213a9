import unittest

from bits import clear_bit, is_power_of_two


class ClearBitTest(unittest.TestCase):
    def test_clear_middle_bit(self):
        self.assertEqual(clear_bit(0b1111, 2), 0b1011)

    def test_clear_unset_bit(self):
        self.assertEqual(clear_bit(0b1000, 1), 0b1000)

    def test_clear_bit_zero(self):
        self.assertEqual(clear_bit(0b11, 0), 0b10)


class PowerOfTwoTest(unittest.TestCase):
    def test_powers(self):
        for value in (1, 2, 8, 1024, 1 << 40):
            self.assertIs(is_power_of_two(value), True, value)

    def test_non_powers(self):
        for value in (0, 3, 6, 12, 1023):
            self.assertFalse(is_power_of_two(value), value)
