import unittest

from invoice import render


class RenderTest(unittest.TestCase):
    def test_layout(self):
        text = render("ACME", [("Widget", 2, 300), ("Gadget", 1, 150)])
        lines = text.splitlines()
        self.assertEqual(lines[0], "Invoice for ACME")
        self.assertEqual(len(lines), 4)
        self.assertTrue(lines[-1].startswith("TOTAL"))


if __name__ == "__main__":
    unittest.main()
