import unittest

from bits import clear_bit, get_bit, toggle_bit


class ClearBitTest(unittest.TestCase):
    def test_clear_middle_bit(self):
        self.assertEqual(clear_bit(0b1111, 2), 0b1011)
        self.assertEqual(clear_bit(1 << 40 | 1, 40), 1)

    def test_clear_unset_bit(self):
        self.assertEqual(clear_bit(0b1000, 1), 0b1000)


class ToggleBitTest(unittest.TestCase):
    def test_toggle_set_bit_off(self):
        self.assertEqual(toggle_bit(0b0101, 2), 0b0001)

    def test_toggle_clear_bit_on(self):
        self.assertEqual(toggle_bit(0b0101, 1), 0b0111)

    def test_toggle_twice_restores(self):
        for value in (0, 1, 0b1010, 255):
            for index in range(9):
                self.assertEqual(toggle_bit(toggle_bit(value, index), index), value, (value, index))

    def test_toggle_only_touches_one_bit(self):
        value = toggle_bit(0b1111_0000, 4)
        self.assertEqual([get_bit(value, i) for i in range(8)], [False] * 5 + [True] * 3)
