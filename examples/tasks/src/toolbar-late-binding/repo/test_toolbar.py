import unittest

from toolbar import Toolbar


class ToolbarTest(unittest.TestCase):
    def test_single_button(self):
        self.assertEqual(Toolbar(["save"]).click("save"), "clicked save")

    def test_unknown_button(self):
        with self.assertRaises(KeyError):
            Toolbar(["save"]).click("print")


if __name__ == "__main__":
    unittest.main()
