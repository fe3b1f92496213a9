import unittest

from toolbar import Toolbar, make_handlers


class HandlersTest(unittest.TestCase):
    def test_each_button_its_own(self):
        bar = Toolbar(["save", "open", "quit"])
        self.assertEqual([bar.click(n) for n in ("save", "open", "quit")],
                         ["clicked save", "clicked open", "clicked quit"])

    def test_handlers_take_no_arguments(self):
        handlers = make_handlers(["a", "b"])
        self.assertEqual([h() for h in handlers], ["clicked a", "clicked b"])

    def test_from_generator(self):
        bar = Toolbar(name for name in ("x", "y"))
        self.assertEqual(bar.click("x"), "clicked x")
